"""Make a small Hugging Face checkpoint offline: random weights (fixed seed) and a byte-level
BPE tokenizer trained with `tokenizers` on Python's own standard-library sources.

Nothing is downloaded: the result is a normal checkpoint directory that transformers'
`AutoModelForCausalLM` / `AutoTokenizer` load, and that orca-serve's real loader reads.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SIZES = {
    # name: (vocab, hidden, layers, heads, kv_heads, intermediate, max_positions, training text bytes)
    "tiny": (4096, 256, 4, 4, 2, 688, 1024, 2_000_000),
    "small": (32000, 768, 12, 12, 4, 2048, 2048, 8_000_000),
}


def training_text(max_bytes: int) -> Iterator[str]:
    """Python source files of the running interpreter's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        yield text
        if total >= max_bytes:
            return


def train_tokenizer(vocab_size: int, max_bytes: int, add_bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(max_bytes), trainer=trainer)
    if add_bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                           special_tokens=[(BOS, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                   chat_template=CHAT_TEMPLATE)


def make_demo_model(out_dir: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
    """Write the checkpoint into out_dir and return its path."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if arch not in ("llama", "gpt2"):
        raise ValueError(f"arch {arch!r} must be 'llama' or 'gpt2'")
    if size not in SIZES:
        raise ValueError(f"size {size!r} must be one of {sorted(SIZES)}")
    vocab, hidden, layers, heads, kv_heads, inter, positions, text_bytes = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab, text_bytes, add_bos=arch == "llama")
    vocab = len(tokenizer)
    bos, eos = tokenizer.convert_tokens_to_ids(BOS), tokenizer.convert_tokens_to_ids(EOS)
    if arch == "llama":
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                             max_position_embeddings=positions, bos_token_id=bos, eos_token_id=eos,
                             tie_word_embeddings=False)
        model_cls = LlamaForCausalLM
    else:
        config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=4 * hidden,
                            n_positions=positions, bos_token_id=bos, eos_token_id=eos)
        model_cls = GPT2LMHeadModel
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
