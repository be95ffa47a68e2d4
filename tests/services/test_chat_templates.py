"""--chat-template and tools in the chat template: the override loads from a file or from the text,
replaces the checkpoint's template (or stands in where there is none), reaches every place that
renders chats, and the template gets OpenAI's tools and tool history in transformers' shapes.
A byte-level tokenizer built in the test (one token per byte, exact decode): no model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine.llm_engine import LLMEngine
from engine.tokenizer import Tokenizer, load_chat_template, load_tokenizer, render_messages
from services.cli import build_parser, engine_config_from_args
from shared.api import decode_generate_request
from shared.config import ModelConfig
from shared.flags import serve_config_from_args
from shared.tools import template_messages

OWN = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
TOOLS_TEMPLATE = (  # newlines as {{ NL }}: transformers renders with trim_blocks (no newline after a tag)
    "{% set NL = '\\n' %}"
    "{% if tools %}TOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ NL }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %} CALL {{ c.function.name }}"
    "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}"
    "{% if m.tool_call_id is defined %} (result of {{ m.tool_call_id }}){% endif %}{{ NL }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def byte_tokenizer(chat_template: str | None = None):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    raw = RawTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=alphabet[0], chat_template=chat_template)


def rendered(tokenizer: Tokenizer, messages, tools=None, chat_template=None) -> str:
    return tokenizer.decode(tokenizer.apply_chat_template(messages, tools, chat_template))


CHAT = [{"role": "user", "content": "hi"}]


def test_the_override_comes_from_a_file_or_the_text(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(OWN)
    assert load_chat_template(str(path)) == OWN
    assert load_chat_template(OWN) == OWN
    assert load_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    long_text = OWN + "{# " + "x" * 5000 + " #}"
    assert load_chat_template(long_text) == long_text, "too long for a path: still a template"


def test_the_override_replaces_the_checkpoints_template_or_stands_in_for_none(tmp_path):
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(byte_tokenizer()).apply_chat_template(CHAT)
    assert rendered(Tokenizer(byte_tokenizer(), OWN), CHAT) == "[user] hi\n"
    own = Tokenizer(byte_tokenizer(TOOLS_TEMPLATE))
    assert rendered(own, CHAT) == "user: hi\nassistant:"
    assert rendered(Tokenizer(byte_tokenizer(TOOLS_TEMPLATE), OWN), CHAT) == "[user] hi\n"
    assert rendered(own, CHAT, chat_template=OWN) == "[user] hi\n", "a per-call override wins too"

    byte_tokenizer(TOOLS_TEMPLATE).save_pretrained(tmp_path / "model")
    path = tmp_path / "t.jinja"
    path.write_text(OWN)
    assert rendered(load_tokenizer(tmp_path / "model"), CHAT) == "user: hi\nassistant:"
    assert rendered(load_tokenizer(tmp_path / "model", str(path)), CHAT) == "[user] hi\n"
    assert rendered(load_tokenizer(tmp_path / "model", OWN), CHAT) == "[user] hi\n"


def test_tools_and_tool_history_reach_the_template():
    messages = template_messages([
        {"role": "developer", "content": "be brief", "name": None},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}])
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    text = rendered(Tokenizer(byte_tokenizer(TOOLS_TEMPLATE)), messages, [WEATHER])
    assert text == ('TOOLS: get_weather\nsystem: be brief\nuser: weather?\n'
                    'assistant:  CALL get_weather{"city": "Oslo"}\ntool: sunny (result of c1)\nassistant:')
    not_json = template_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "oops"}}]}])
    assert not_json[0]["tool_calls"][0]["function"]["arguments"] == "oops"


def nats_request(**fields):
    """A NATS / `orca generate` request body, decoded as they are."""
    return decode_generate_request(json.dumps({"id": "r", "messages": [{"role": "user", "content": "weather?"}],
                                               **fields}))


def test_generate_requests_render_their_tools_and_history():
    tokenizer = Tokenizer(byte_tokenizer(TOOLS_TEMPLATE))
    request = nats_request(tools=[WEATHER])
    assert tokenizer.decode(render_messages(tokenizer, request)).startswith("TOOLS: get_weather\nuser: weather?")
    assert not tokenizer.decode(render_messages(tokenizer, nats_request(tools=[WEATHER], tool_choice="none"))) \
        .startswith("TOOLS")
    history = nats_request(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}], tools=[WEATHER])
    text = tokenizer.decode(render_messages(tokenizer, history))
    assert "CALL get_weather{}" in text and "tool: sunny (result of c1)" in text
    assert "None" not in text, "absent fields are left out, not rendered as None"


def test_orca_generate_renders_with_the_configured_template():
    """LLMEngine.prompt_ids (what `orca generate` tokenizes with) takes ModelConfig.chat_template."""
    tokenizer = Tokenizer(byte_tokenizer(TOOLS_TEMPLATE))
    engine = SimpleNamespace(tokenizer=tokenizer, config=SimpleNamespace(model=ModelConfig(model="m",
                                                                                           chat_template=OWN)))
    ids = LLMEngine.prompt_ids(engine, nats_request())
    assert tokenizer.decode(ids) == "[user] weather?\n"
    engine.config.model = ModelConfig(model="m")
    assert tokenizer.decode(LLMEngine.prompt_ids(engine, nats_request(tools=[WEATHER]))).startswith("TOOLS:")


def test_the_flag_is_an_engine_flag(tmp_path, monkeypatch):
    monkeypatch.delenv("ORCA_CHAT_TEMPLATE", raising=False)
    args = ["generate", "--model", str(tmp_path), "--input", "-", "--output", "-"]
    assert engine_config_from_args(build_parser().parse_args(args)).model.chat_template is None
    config = engine_config_from_args(build_parser().parse_args([*args, "--chat-template", OWN]))
    assert config.model.chat_template == OWN
    monkeypatch.setenv("ORCA_CHAT_TEMPLATE", "/templates/t.jinja")
    assert engine_config_from_args(build_parser().parse_args(args)).model.chat_template == "/templates/t.jinja"
    with pytest.raises(ValueError, match="chat_template is empty"):
        ModelConfig(model="m", chat_template=" ")


def test_a_bad_chat_template_stops_orca_generate_with_one_line(tmp_path, capsys):
    from services.cli import main

    code = main(["generate", "--model", str(tmp_path), "--input", "-", "--output", "-",
                 "--chat-template", str(tmp_path / "nope.jinja")])
    assert code == 2 and "neither a file nor a Jinja template" in capsys.readouterr().err


def test_orca_serve_passes_the_template_to_the_tokenizer_and_the_gateway(tmp_path, monkeypatch):
    from services import serve

    started = {}

    class Recorder:
        def __init__(self, name, command, *args, **kwargs):
            started[name] = command([])

        def start(self, now):
            return self

    monkeypatch.setattr(serve, "SupervisedProcess", Recorder)
    parsed = build_parser().parse_args(["serve", "--model", str(tmp_path), "--chat-template", OWN])
    config = engine_config_from_args(parsed)
    serve.start_services(serve_config_from_args(parsed), "nats://x", config, tmp_path)
    tokenizer = started["tokenizer"]
    assert tokenizer[tokenizer.index("--chat-template") + 1] == OWN
    assert tokenizer[tokenizer.index("--model") + 1] == str(tmp_path)

    settings = {}
    monkeypatch.setattr("services.gateway.app.start_on_ray_serve", lambda s, host, http_port: settings.update(s=s))
    serve.start_gateway(parsed, "nats://x", config, http_port=None)
    assert settings["s"].chat_template == OWN


STRICT_TEMPLATE = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversation roles must start "
                   "with user') }}{% endif %}" + OWN)


def test_a_chat_template_that_rejects_the_messages_is_a_clear_error_where_requests_come_in():
    """A template's raise_exception (role alternation, say) raises a Jinja error, not a ValueError: over NATS it
    must still be an error event for that request (it was raised past the service, and the client waited)."""
    import asyncio

    from services.tokenizer.service import TokenizerService
    from tests.fake_nats import RecordingNats

    tokenizer = Tokenizer(byte_tokenizer(STRICT_TEMPLATE))
    assistant_first = nats_request(messages=[{"role": "assistant", "content": "hello"}])
    with pytest.raises(ValueError, match="the chat template rejected the messages: Conversation roles must start"):
        render_messages(tokenizer, assistant_first)

    async def go():
        nc = RecordingNats()
        service = TokenizerService(nc, tokenizer, vocab_size=256, instance="tok")
        body = json.dumps({"id": "r", "messages": [{"role": "assistant", "content": "hello"}], "max_tokens": 2})
        await service.on_generate(SimpleNamespace(data=body.encode(), reply="client.inbox", headers=None))
        return [json.loads(data) for data in nc.on("client.inbox")]

    events = asyncio.run(go())
    assert len(events) == 1 and events[0]["finish_reason"] == "error", events
    assert "Conversation roles must start with user" in events[0]["error"]


THINKING = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}assistant:")


def test_chat_template_kwargs_reach_the_template_in_every_place_that_renders_chats():
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking): variables for the template, from the gateway
    and from a NATS or `orca generate` request alike; a key the rendering itself sets is refused by name."""
    tokenizer = Tokenizer(byte_tokenizer(THINKING))

    def text(**kwargs) -> str:
        return tokenizer.decode(tokenizer.apply_chat_template(CHAT, **kwargs))

    assert text() == "user: hi\nassistant:"
    assert text(template_kwargs={"enable_thinking": False}) == "user: hi\n<no-think>assistant:"
    request = decode_generate_request(json.dumps({"id": "r", "messages": CHAT,
                                                  "chat_template_kwargs": {"enable_thinking": False}}).encode())
    assert tokenizer.decode(render_messages(tokenizer, request)) == "user: hi\n<no-think>assistant:"
    for key in ("add_generation_prompt", "tokenize", "messages", "tools"):
        with pytest.raises(ValueError, match=f"chat_template_kwargs may not set '{key}'"):
            text(template_kwargs={key: True})
    with pytest.raises(ValueError, match="chat_template_kwargs need messages"):
        decode_generate_request(b'{"id": "r", "prompt": "x", "chat_template_kwargs": {"enable_thinking": false}}')
