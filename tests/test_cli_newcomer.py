"""What a newcomer meets first (issue 47): --help at once (no torch), prompt errors before
any load, sizes that agree between make-model and info, eval's headline on stdout, help
text on every option, readable --spec-type, info on the default model."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from kvcompile.cli import build_parser

MISSING_MODEL = "/nonexistent/model.gguf"


def cli(*args, stdin: bytes | None = None, importtime: bool = False):
    """The CLI in a subprocess; with importtime, stderr also lists every module imported."""
    flags = ["-X", "importtime"] if importtime else []
    r = subprocess.run([sys.executable, *flags, "-m", "kvcompile", *args], input=stdin,
                       capture_output=True, timeout=300)
    return r.returncode, r.stdout.decode(), r.stderr.decode()


def imported(stderr: str) -> set[str]:
    """Top-level packages named in -X importtime's lines."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0]
            for line in stderr.splitlines() if line.startswith("import time:") and "|" in line}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["", *subcommands()])
def test_help_imports_no_torch(command):
    rc, out, err = cli(*([command] if command else []), "--help", importtime=True)
    assert rc == 0 and out.startswith("usage: kvcompile"), err[-2000:]
    assert "torch" not in imported(err)
    assert "kvcompile" in imported(err)          # the check sees imports at all


@pytest.mark.parametrize("args,stdin,words", [
    (["generate", "-f", "-"], b"ab\xffcd", "-f - (stdin): not UTF-8 text (byte 2)"),
    (["eval", "-f", "-"], b"ab\xffcd", "-f - (stdin): not UTF-8 text (byte 2)"),
    (["generate", "-f", "-"], b"", "the prompt is empty (-f - (stdin) holds no text)"),
    (["generate", ""], None, "the prompt is empty (the prompt argument holds no text)"),
    (["eval", "-f", "-"], b"", "-f - (stdin) holds no text"),
], ids=["generate-bad-bytes", "eval-bad-bytes", "generate-empty-stdin", "generate-empty-arg",
        "eval-empty-stdin"])
def test_prompt_errors_come_before_any_load(args, stdin, words):
    """A prompt error is reported, as one line, before the model path is even looked at
    and before torch is imported."""
    rc, _, err = cli(*args, "-m", MISSING_MODEL, stdin=stdin, importtime=True)
    last = err.strip().splitlines()[-1]
    assert rc == 1 and "Traceback" not in err, err[-2000:]
    assert last.startswith("kvcompile: error:") and words in last, last
    assert "torch" not in imported(err)


def test_a_bad_option_still_fails_before_the_model_loads():
    rc, _, err = cli("generate", "hi", "--temperature", "inf", "-m", MISSING_MODEL)
    last = err.strip().splitlines()[-1]
    assert rc == 1 and "Traceback" not in err
    assert "temperature must be a finite number >= 0" in last and "inf" in last, last


def test_make_model_sizes_agree_with_info(tmp_path):
    out = tmp_path / "tiny.gguf"
    rc, made, err = cli("make-model", "--arch", "llama", "--preset", "tiny", "--out", str(out))
    assert rc == 0, err
    m = re.search(r": (\S+ [KMB]) params, (\S+ [KMG]?i?B) in (\d+) tensors", made)
    assert m is not None, made
    rc, info, err = cli("info", str(out))
    assert rc == 0, err
    i = re.search(r"parameters\s+(\S+ [KMB]) in (\d+) tensors, (\S+ [KMG]?i?B)", info)
    assert i is not None, info
    assert (m.group(1), m.group(2), m.group(3)) == (i.group(1), i.group(3), i.group(2))
    assert m.group(1) != "0.00 B" and m.group(2) != "0.00 GiB"


def test_make_model_lists_the_writers_weight_types():
    from kvcompile.io.gguf.synthetic import WEIGHT_TYPES
    from kvcompile.io.make_model import WEIGHT_TYPE_NAMES
    assert WEIGHT_TYPE_NAMES == tuple(sorted(WEIGHT_TYPES))


@pytest.mark.parametrize("command", list(subcommands()))
def test_every_option_has_help(command):
    missing = [a.option_strings or a.dest for a in subcommands()[command]._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not missing, f"{command}: {missing}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvcompile.io.make_model import make_model
    path = tmp_path_factory.mktemp("newcomer") / "tiny.gguf"
    make_model("llama", "tiny", path, weight_type="f32", seed=3)
    return path


def test_eval_prints_its_perplexity_on_stdout(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the ferry leaves at dawn and returns before the tide turns " * 12)
    rc, out, err = cli("eval", "-m", str(tiny), "-f", str(text), "--chunk", "64", "-c", "1024",
                       "--no-progress")
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) >= 3 and all(line.startswith("[") for line in lines[:-1]), out
    assert re.fullmatch(r"all \d+ tokens: perplexity \d+\.\d{4}", lines[-1]), lines[-1]
    assert "perplexity" not in err


def test_spec_type_lists_each_choice_once():
    gen = subcommands()["generate"]
    (action,) = [a for a in gen._actions if "--spec-type" in a.option_strings]
    names = [n for c in (action.choices or ()) for n in c.split(",")]
    assert len(names) == len(set(names)), action.choices
    text = gen.format_help()
    for group in re.findall(r"\{([^}]*)\}", text):          # any braced choice list
        items = [c.strip() for c in group.split(",")]
        assert len(items) == len(set(items)), group
    assert all(name in text for name in ("none", "ngram-simple", "draft-mtp"))


def test_spec_type_takes_the_engines_types_in_any_order(capsys):
    from kvcompile.engine.speculative.options import SPEC_TYPES
    gen = build_parser()
    parsed = {text: gen.parse_args(["generate", "x", "--spec-type", text]).spec_type
              for text in ("none", "ngram-simple", "draft-mtp", "ngram-simple,draft-mtp",
                           "draft-mtp,ngram-simple", "Draft-MTP")}
    assert parsed["draft-mtp,ngram-simple"] == "ngram-simple,draft-mtp"
    assert parsed["Draft-MTP"] == "draft-mtp"
    assert set(parsed.values()) == set(SPEC_TYPES)
    for bad in ("bogus", "draft-mtp,draft-mtp", ""):
        with pytest.raises(SystemExit):
            gen.parse_args(["generate", "x", "--spec-type", bad])
        err = capsys.readouterr().err
        assert "--spec-type: expected none, ngram-simple or draft-mtp" in err, err


def test_info_without_a_path_describes_the_default_model(smollm2_path):
    rc, out, err = cli("info")
    assert rc == 0, err
    assert str(smollm2_path) in out.splitlines()[0] and "llama" in out
    assert out == cli("info", str(smollm2_path))[1]
