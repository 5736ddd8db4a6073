"""The CLI as a user runs it: a subprocess, output on stdout, errors without tracebacks."""
import subprocess
import sys

import pytest


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvcompile", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_streams_text_and_stats():
    r = cli("generate", "Once upon a time", "-n", "12", "--temperature", "0", "--no-progress")
    print(r.stdout, r.stderr)
    assert r.returncode == 0 and len(r.stdout.strip()) > 0
    assert "12 generated" in r.stderr and "decode" in r.stderr


@pytest.mark.parametrize("args,words", [
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "0"], "top_p"),
    (["generate", "hi", "--top-k", "-1"], "top_k"),
    (["generate", "hi", "--repeat-last-n", "-2"], "repeat_last_n"),
    (["generate", "hi", "-m", "/nonexistent/model.gguf"], "does not exist"),
    (["generate", "hi", "-ctk", "q3_k"], "KV cache type"),
    (["generate", "hi", "--dtype", "int8"], "dtype"),
    (["info", __file__], "GGUF"),
    (["generate", "hi", "--system", "be brief"], "--system needs --chat"),
    (["generate", "hi", "--trace"], "--kv-stream-arena-mib"),
    (["generate", "hi", "-c", "0"], "ctx_size (--ctx-size) must be a positive integer"),
    (["generate", "hi", "--device", "foo"], "not a device name"),
    (["generate"], "no prompt"),
    (["generate", "hi", "-f", __file__], "give the prompt once"),
    (["generate", "-f", "/nonexistent/prompt.txt"], "no such file"),
    (["generate", "-f", sys.executable], "not UTF-8"),
    (["generate", "hi", "--system-file", __file__], "--system needs --chat"),
], ids=["temperature", "top-p", "top-k", "repeat-last-n", "missing-model",
        "cache-type", "dtype", "not-gguf", "system-without-chat", "trace-without-arena",
        "ctx-0", "device-name", "no-prompt", "prompt-twice", "missing-file", "binary-file",
        "system-file-without-chat"])
def test_errors_are_one_clear_line(args, words):
    r = cli(*args)
    print(r.stderr)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvcompile: error:") and words in last


def test_info_reports_geometry_and_kv_bytes(smollm2_path):
    r = cli("info", smollm2_path)
    print(r.stdout)
    assert r.returncode == 0
    for word in ("llama", "30", "576", "q8_0", "q4_0"):
        assert word in r.stdout


def test_cuda_graphs_flag_reports_its_programs():
    # on the CPU the programs rerun in their fixed layouts: the same text, plus their line
    plain = cli("generate", "Once upon a time", "-n", "6", "--temperature", "0", "--no-progress")
    r = cli("generate", "Once upon a time", "-n", "6", "--temperature", "0", "--no-progress",
            "--cuda-graphs")
    print(r.stderr)
    assert r.returncode == 0 and r.stdout == plain.stdout
    assert "[cuda graphs:" in r.stderr and "steps replayed" in r.stderr


def test_graphs_line_names_decode_replays_and_a_fallback():
    from kvcompile.cli import _graphs_line
    ok = _graphs_line({"programs": 2, "captures": 2, "replays": 31, "eager_steps": 1})
    assert ok == "[cuda graphs: 31 steps replayed, 2 captured, 1 uncaptured]"
    bad = _graphs_line({"programs": 0, "captures": 0, "replays": 0, "eager_steps": 9,
                        "fallback": "RuntimeError: x"})
    assert "capture failed, uncaptured from then on: RuntimeError: x" in bad
    traced = _graphs_line({"programs": 1, "captures": 1, "replays": 7, "eager_steps": 1,
                           "compiled": True, "retraces": 0})
    assert traced == "[cuda graphs: 7 steps replayed, 1 captured, 1 uncaptured, traced forward]"
    eager = _graphs_line({"programs": 1, "captures": 1, "replays": 7, "eager_steps": 1,
                          "compiled": False, "trace_error": "PassError: y"})
    assert eager.endswith("; trace failed, eager model in the graphs: PassError: y]")


def test_prompt_from_a_file_and_from_stdin(tmp_path):
    """-f FILE and -f - (stdin) give the same text as the prompt argument; a long file
    (beyond what one command-line argument may hold, 128 KiB on Linux) gets the clear
    context-length error instead of a shell failure."""
    prompt = "Once upon a time"
    (tmp_path / "p.txt").write_text(prompt, encoding="utf-8")
    base = ["-n", "6", "--temperature", "0", "--no-progress"]
    plain = cli("generate", prompt, *base)
    by_file = cli("generate", "-f", str(tmp_path / "p.txt"), *base)
    by_stdin = subprocess.run([sys.executable, "-m", "kvcompile", "generate", "-f", "-", *base],
                              input=prompt, capture_output=True, text=True, timeout=300)
    assert plain.returncode == by_file.returncode == by_stdin.returncode == 0, by_file.stderr
    assert plain.stdout == by_file.stdout == by_stdin.stdout and plain.stdout.strip()

    (tmp_path / "long.txt").write_text("the river runs under the old bridge. " * 8000,
                                       encoding="utf-8")
    r = cli("generate", "-f", str(tmp_path / "long.txt"), *base)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert last.startswith("kvcompile: error:") and "ctx-size" in last

