"""The terminal: `generate` streams (or prints one JSON object), reads its prompt from stdin or `-`, uses the
chat template by default (`--raw` not), colours tokens by source; `chat` holds a conversation in a real
pseudo-terminal (history, /clear, /exit, a statistics line per answer); Ctrl-C stops an answer, not the
program. A tiny random target and draft with a 97-token character tokenizer."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from blockspec import LLM, SamplingParams
from blockspec.models.config import ModelConfig
from blockspec.outputs import StreamDelta
from blockspec.terminal.render import InterruptFlag, Painter
from tests.tiny import write_tiny_draft, write_tiny_target, write_tiny_tokenizer

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("terminal")
    target = write_tiny_tokenizer(write_tiny_target(root / "target"))
    draft = write_tiny_draft(root / "draft", ModelConfig.from_folder(target), block_size=4)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(model_path=tiny[0], draft_model_path=tiny[1], adaptive_speculation=False)


def cli(tiny, *args, stdin: str | None = None):
    target, draft = tiny
    return subprocess.run([sys.executable, "-m", "blockspec", "generate", "--model-path", target,
                           "--draft-model-path", draft, "--max-new-tokens", "24", *args],
                          input=stdin, capture_output=True, text=True, timeout=300)


def test_generate_streams_the_chat_answer_by_default(tiny, llm):
    want = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=24))[0]
    out = cli(tiny, "hello")
    assert out.returncode == 0, out.stderr
    assert out.stdout == want.text + "\n"
    assert "tok/s decode" in out.stderr and "tau=" in out.stderr
    assert cli(tiny, "hello", "--chat").stdout == out.stdout
    raw = cli(tiny, "hello", "--raw")
    assert raw.stdout == llm.generate("hello", SamplingParams(max_tokens=24))[0].text + "\n"


def test_the_prompt_from_stdin(tiny):
    wanted = cli(tiny, "What is 1+1?").stdout
    assert cli(tiny, "-", stdin="What is 1+1?\n").stdout == wanted
    assert cli(tiny, stdin="What is 1+1?\n").stdout == wanted  # piped, no argument
    empty = cli(tiny, "-", stdin="")
    assert empty.returncode == 2 and "standard input is empty" in empty.stderr
    nothing = cli(tiny, stdin="")  # no argument and empty input (make, CI): the demo prompt, said so
    assert nothing.returncode == 0 and "using the demo prompt" in nothing.stderr


def test_no_prompt_says_which_it_uses(monkeypatch, capsys):
    from blockspec.terminal.cli import DEMO_PROMPT, read_prompt

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    assert read_prompt(None) == DEMO_PROMPT
    assert DEMO_PROMPT in capsys.readouterr().err


def test_json_stays_one_object(tiny):
    out = cli(tiny, "hello", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["num_output_tokens"] <= 24
    got = json.loads(out.stdout)
    assert len(got["token_sources"]) == got["num_output_tokens"] and got["cached_tokens"] == 0


def test_color_marks_the_sources_and_keeps_the_text(tiny):
    plain = cli(tiny, "abcabcabcabc abcabc", "--prompt-lookup-ngram", "1")
    colored = cli(tiny, "abcabcabcabc abcabc", "--prompt-lookup-ngram", "1", "--color")
    assert ANSI.sub("", colored.stdout) == plain.stdout
    assert "\x1b[" in colored.stdout and "colours:" in colored.stderr


def test_painter_stops_where_the_text_does(llm):
    """With a stop string the coloured answer ends exactly where the plain one does."""
    params = SamplingParams(max_tokens=30, stop=["e"])
    colored, plain = io.StringIO(), io.StringIO()
    painters = [Painter(True, colored), Painter(False, plain)]
    for delta in llm.stream("stop test", params):
        for painter in painters:
            painter.add(delta)
        assert "".join(p.text for p in delta.pieces) == delta.text
    assert ANSI.sub("", colored.getvalue()) == plain.getvalue() == delta.output.text


def test_stream_pieces_carry_the_token_sources(llm):
    """A stream's deltas carry the engine's (source, step) per token, and its pieces spell the text."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    deltas = list(llm.stream("abcabcabcabc abcabc", params))
    out = deltas[-1].output
    tokens = [(s, step) for d in deltas for s, step in d.token_sources]
    assert tokens == out.token_sources and len(out.token_sources) == len(out.token_ids)
    assert {s for s, _ in out.token_sources} <= {"draft", "lookup", "target"}
    assert "".join(p.text for d in deltas for p in d.pieces) == out.text


def test_a_stream_stops_between_steps_with_what_it_has(llm):
    deltas = []
    for delta in llm.stream("hello there", SamplingParams(max_tokens=60, ignore_eos=True),
                            should_stop=lambda: len(deltas) >= 3):
        deltas.append(delta)
    out = deltas[-1].output
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 60
    assert out.text == "".join(d.text for d in deltas)
    assert llm.runner.slots_available == llm.runner.pool.num_slots  # its slot came back (free or cached)
    whole = llm.generate("hello there", SamplingParams(max_tokens=60, ignore_eos=True))[0]
    assert whole.token_ids[: len(out.token_ids)] == out.token_ids


def test_ctrl_c_sets_a_flag_inside_and_interrupts_outside():
    # Python's own Ctrl-C handler first: a process started in the background inherits SIGINT ignored
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with InterruptFlag() as flag:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            assert flag.set
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, before)


def converse(tiny, lines: list[str], timeout: float = 120.0) -> str:
    """Run `blockspec chat` on a pseudo-terminal, type `lines` one by one (each after the prompt), return
    everything it showed."""
    target, draft = tiny
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "blockspec", "chat", "--model-path", target,
                             "--draft-model-path", draft, "--max-new-tokens", "16"],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    shown, pending, deadline = b"", list(lines), time.time() + timeout
    try:
        while time.time() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the program ended
                    break
                shown += chunk
                if pending and shown.rstrip().endswith(b">>>"):
                    os.write(master, pending.pop(0).encode() + b"\n")
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=30) == 0, shown.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return shown.decode(errors="replace")


def test_chat_holds_a_conversation(tiny):
    shown = converse(tiny, ["hello", "and again", "/clear", "fresh start", "/exit"])
    assert shown.count("tok/s decode") == 3  # a statistics line per answer
    assert "prompt tokens cached" in shown  # the second turn reuses the first's KV (the prefix cache)
    assert "(the conversation starts over)" in shown and "/clear starts over" in shown


def test_stop_strings_in_the_api_end_where_plain_decoding_does(llm):
    full = llm.generate("stop test", SamplingParams(max_tokens=30, ignore_eos=True))[0].text
    stop = full[10:12]
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop, "never there"])
    spec = llm.generate("stop test", params)[0]
    plain = llm.generate("stop test", params, speculative_algorithm="NONE")[0]
    assert spec.text == plain.text == full[: full.find(stop)] and spec.finish_reason == "stop"
    assert spec.token_ids == plain.token_ids  # the tokens through the one that completed the stop string
    decode = llm.tokenizer.decode
    assert stop in decode(spec.token_ids) and stop not in decode(spec.token_ids[:-1])
    assert len(spec.token_sources) == len(spec.token_ids)


def test_a_reader_that_goes_away_is_no_error(tiny):
    target, draft = tiny
    cmd = (f"{sys.executable} -m blockspec generate --model-path {target} --draft-model-path {draft} "
           f"--max-new-tokens 60 --raw --prompt-lookup-ngram 0 'hello' | head -c 1")
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr


def test_no_draft_steps_is_said_not_a_tau_of_zero():
    """A DFlash request that drafted nothing (plain and lookup steps only): the line says "no draft steps",
    and the JSON's tau is null, as the lookup's is without lookup steps."""
    from blockspec.engine.stats import RequestStats
    from blockspec.outputs import RequestOutput
    from blockspec.terminal.render import stats_line

    def output(stats: RequestStats, algorithm: str = "DFLASH") -> RequestOutput:
        return RequestOutput([1], "ab", [5, 6, 7], "length", algorithm, 4, 0.1, 0.2, stats)

    line = stats_line(output(RequestStats(lookup_accept_lengths=[3], plain_steps=2)))
    assert "no draft steps (2 plain steps); 1 prompt-lookup steps (tau 3.00)" in line and "tau=" not in line
    assert RequestStats(plain_steps=2).summary()["mean_accept_length"] is None
    assert RequestStats().mean_accept_length is None
    drafted = stats_line(output(RequestStats(accept_lengths=[2, 3], plain_steps=1)))
    assert "tau=2.50 over 2 DFlash steps + 1 plain steps" in drafted
    assert "tau" not in stats_line(output(RequestStats(plain_steps=3), "NONE"))
