"""Incremental detokenization: no garbled characters at chunk edges, stop strings never leak."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from core.detokenize import IncrementalDetokenizer


def byte_decode(ids) -> str:
    """A byte-level 'tokenizer': token id = one byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def stream(text: str, stop=(), chunk=1) -> tuple[str, list[str], bool]:
    detok = IncrementalDetokenizer(byte_decode, stop)
    data = list(text.encode())
    pieces = [detok.add(data[i:i + chunk]) for i in range(0, len(data), chunk)]
    pieces.append(detok.flush())
    return "".join(pieces), pieces, detok.stopped


def test_multibyte_characters_are_never_split():
    text = "naïve 日本語 🙂!"
    joined, pieces, _ = stream(text)
    assert joined == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_cut_and_nothing_after_it_is_emitted():
    joined, pieces, stopped = stream("hello STOP world", stop=["STOP"])
    assert joined == "hello " and stopped


def test_stop_string_spanning_chunks_is_never_partly_emitted():
    joined, pieces, _ = stream("abc\n\ndef", stop=["\n\n"])
    assert joined == "abc"


# U+FFFD itself left out: at the very end it cannot be told from the bytes of a character that never
# completed, which are dropped (as vLLM drops them)
TEXT = st.text(alphabet=st.characters(codec="utf-8", blacklist_characters="\ufffd"), max_size=40)


@given(TEXT, st.text(min_size=1, max_size=4), st.integers(1, 5))
def test_streamed_text_is_the_text_up_to_the_first_stop(text, stop, chunk):
    joined, _, stopped = stream(text, stop=[stop], chunk=chunk)
    if stop in text:
        assert stopped and joined == text[:text.index(stop)]
    else:
        assert joined == text


def test_what_is_streamed_is_the_text_even_when_the_output_ends_inside_a_character():
    """The final flush's own text was kept in `text` but not returned: a stream and `orca generate` (which
    reads `text`) disagreed at the end of an output cut inside a character, or held back for a stop string."""
    detok = IncrementalDetokenizer(byte_decode, ())
    data = list("ab 日".encode())[:-1]  # the last character never completes
    joined = "".join(detok.add([b]) for b in data) + detok.flush()
    assert joined == detok.text == "ab ", "its bytes are dropped, as vLLM drops them"
    detok = IncrementalDetokenizer(byte_decode, ("xyz",))
    joined = "".join(detok.add([b]) for b in list("abc x".encode()) + [0xE6]) + detok.flush()
    assert joined == detok.text == "abc x"


@given(st.binary(max_size=40), st.lists(st.text(min_size=1, max_size=3), max_size=2), st.integers(1, 5))
def test_the_pieces_streamed_always_join_to_the_text(data, stop, chunk):
    detok = IncrementalDetokenizer(byte_decode, stop)
    pieces = [detok.add(list(data[i:i + chunk])) for i in range(0, len(data), chunk)]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    assert not detok.text.endswith("\ufffd") or detok.stopped


@given(TEXT, st.text(st.characters(codec="utf-8"), min_size=1, max_size=4), st.integers(1, 8))
def test_tokens_given_together_are_taken_up_to_the_one_that_completes_the_stop(text, stop, chunk):
    data = list(text.encode())
    one_by_one = IncrementalDetokenizer(byte_decode, [stop])
    for i, b in enumerate(data):
        one_by_one.add([b])
        if one_by_one.stopped:
            data_needed = i + 1
            break
    else:
        data_needed = len(data)
    together = IncrementalDetokenizer(byte_decode, [stop])
    pieces, taken = [], 0
    for i in range(0, len(data), chunk):
        piece, n = together.add_until_stop(data[i:i + chunk])
        pieces.append(piece)
        taken += n
        assert n == len(data[i:i + chunk]) or together.stopped, "only a stop leaves tokens untaken"
    pieces.append(together.flush())
    assert taken == data_needed and together.token_ids == data[:data_needed]
    assert "".join(pieces) == together.text == one_by_one.text


def test_a_final_stop_token_is_taken_but_its_text_is_not_the_outputs():
    """vLLM's rule: a request that ends on one of its stop token ids keeps the token, not its text."""
    detok = IncrementalDetokenizer(byte_decode, stop_token_ids=[ord("$")])
    assert detok.add_output(list(b"a$b"), engine_stopped=False) == ("a$b", 3), "a stop token mid-output is text"
    assert detok.add_output(list(b"c$"), engine_stopped=True) == ("c", 2)
    assert detok.text == "a$bc"


def test_an_output_that_ends_otherwise_keeps_its_last_tokens_text():
    for stopped, last in ((True, "x"), (False, "$"), (False, "E")):  # a grammar's end; max_tokens (twice)
        detok = IncrementalDetokenizer(byte_decode, stop_token_ids=[ord("$")], eos_token_ids=[ord("E")])
        assert detok.add_output(list(f"a{last}".encode()), engine_stopped=stopped) == (f"a{last}", 2)


def test_eos_that_ends_an_output_is_taken_without_its_text_and_is_no_stop_reason():
    """With skip_special_tokens off EOS has text (`<|end_of_text|>`): vLLM leaves it out as it does a stop
    token's (include_stop_str_in_output keeps it), and checks EOS first, so an EOS that is also a stop token
    id gives stop_reason null. Under ignore_eos it is a stop token like any other."""
    from shared.sampling import SamplingParams

    def detok(**params) -> IncrementalDetokenizer:
        return IncrementalDetokenizer.of(lambda ids, **_: byte_decode(ids), SamplingParams(**params), [ord("E")])

    d = detok(stop_token_ids=(ord("E"),))
    assert d.add_output(list(b"abE"), engine_stopped=True) == ("ab", 3) and d.stop_reason is None
    d = detok(include_stop_str_in_output=True)
    assert d.add_output(list(b"abE"), engine_stopped=True) == ("abE", 3) and d.stop_reason is None
    d = detok(stop_token_ids=(ord("E"),), ignore_eos=True)
    assert d.add_output(list(b"abE"), engine_stopped=True) == ("ab", 3) and d.stop_reason == ord("E")


def test_a_stop_string_before_the_stop_token_wins():
    detok = IncrementalDetokenizer(byte_decode, stop=("ab",), stop_token_ids=[ord("$")])
    text, taken = detok.add_output(list(b"xab$"), engine_stopped=True)
    assert (text + detok.flush(), taken, detok.stopped) == ("x", 3, True)


def test_include_stop_keeps_the_stop_string_or_the_stop_tokens_text():
    """vLLM's include_stop_str_in_output: the text ends with what ended it."""
    detok = IncrementalDetokenizer(byte_decode, stop=("ST", "STOP"), include_stop=True)
    assert detok.add(list(b"hello STOP world")) + detok.flush() == "hello STOP"
    detok = IncrementalDetokenizer(byte_decode, stop_token_ids=[ord("$")], include_stop=True)
    assert detok.add_output(list(b"a$"), engine_stopped=True) == ("a$", 2)


def test_stop_reason_names_the_stop_string_or_the_stop_token_id_that_ended_it():
    """vLLM's stop_reason: the string that matched (of two at one place, the longer), or the id; None otherwise."""
    detok = IncrementalDetokenizer(byte_decode, stop=("ST", "STOP", "end"))
    detok.add(list(b"say STOP now, end"))
    assert detok.stop_reason == "STOP"
    detok = IncrementalDetokenizer(byte_decode, stop=("zz",), stop_token_ids=[ord("$"), ord("#")])
    detok.add_output(list(b"a$b"), engine_stopped=False)
    assert detok.stop_reason is None, "a stop token that did not end the request"
    detok.add_output(list(b"c#"), engine_stopped=True)
    assert detok.stop_reason == ord("#")
    for stopped, last in ((True, "x"), (False, "$")):  # EOS (or a grammar's end), or max_tokens
        detok = IncrementalDetokenizer(byte_decode, stop=("zz",), stop_token_ids=[ord("$")])
        detok.add_output(list(f"a{last}".encode()), engine_stopped=stopped)
        assert detok.stop_reason is None
    detok = IncrementalDetokenizer(byte_decode, stop=("ab",), stop_token_ids=[ord("$")])
    detok.add_output(list(b"xab$"), engine_stopped=True)
    assert detok.stop_reason == "ab", "the stop string came first"
