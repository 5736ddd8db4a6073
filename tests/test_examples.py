"""Each script in examples/ runs as a user would run it (a subprocess on the CPU, the
default model, small sizes) and prints what its docstring promises."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STATS = re.compile(r"\[(\d+) prompt tokens(?: \((\d+) cached\))?, (\d+) generated")


def run(script: str, *args, stdin: str | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, str(EXAMPLES / script), *args], input=stdin,
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    print(r.stdout, r.stderr[-2000:])
    assert r.returncode == 0 and "Traceback" not in r.stderr
    return r


def test_every_example_has_a_test():
    tested = {"quickstart.py", "long_text_qa.py", "chat.py", "speculative.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_quickstart_generates_and_reports():
    r = run("quickstart.py", "Once upon a time")
    text, stats = r.stdout.strip().rsplit("\n", 1)
    assert text.strip() and STATS.search(stats) and "decode" in stats


def test_long_text_qa_streams_the_kv_through_a_small_arena():
    r = run("long_text_qa.py", str(ROOT / "tests" / "data" / "parity_text.txt"),
            "What does the blue notebook wait for?", "--arena-mib", "4", "--ctx-size", "2048")
    prompt = int(STATS.search(r.stdout).group(1))
    assert prompt > 1000                            # the whole text went in
    assert "copied host -> device" in r.stdout      # and its KV streamed


def test_chat_keeps_the_history():
    r = run("chat.py", "--max-tokens", "8", "--ubatch-size", "16",
            stdin="What is 2 + 3?\nAnd times 4?\n")
    turns = [tuple(int(g or 0) for g in m.groups()) for m in STATS.finditer(r.stderr)]
    assert len(turns) == 2
    (p1, c1, g1), (p2, c2, _) = turns
    assert p2 > p1 + g1                             # the second prompt holds the first turn
    # and prefills only what is new: the first turn's prompt and reply are reused (the
    # reply's text may tokenize otherwise in the template: its first token at least), cut
    # back to a multiple of the prefill chunk so the chunks are a cold run's
    assert c1 == 0 and p1 - 16 < c2 < p2 and c2 % 16 == 0, turns


def test_speculative_gives_the_same_tokens_in_fewer_forwards():
    r = run("speculative.py", "--max-tokens", "32")
    assert "same tokens: True" in r.stdout
    forwards, tokens = map(int, re.search(r"(\d+) verify forwards for (\d+) tokens",
                                          r.stdout).groups())
    assert forwards < tokens
