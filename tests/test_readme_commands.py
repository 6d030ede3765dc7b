"""Every command in README.md runs as written (DESIGN.md: "a test runs them").

The README's fenced code blocks are read at collection time. Every `megatronapp` line of a shell block, and every
Python block, becomes one test case; the cases run in README order in one shared directory (the working directory
of every command), so a command finds what an earlier one wrote (`--resume runs/a/checkpoints/latest`,
`scan aggregate runs/t`, `dpp plot runs/x/trace`). Run this module whole: a case alone may miss its inputs.

What the test changes, and nothing else:
- `megatronapp train` gets a small `--steps` (added, or replacing the README's value): 2; 4 with `--resume` (past
  the step-2 checkpoint it continues); with `--trace`, the trace interval (README's `--trace-interval`, else the
  config default), because a run shorter than one interval records no trace window.
- Fixtures written into the directory first: `my.yaml` is the README's own yaml block that starts `# my.yaml`;
  `path/to/llama-dir` (the README's placeholder for an HF directory) is a tiny random Llama saved by
  `transformers`, with a `tokenizer.json`.
- `scope serve` (a server that runs until stopped) counts as run when it prints its URL and `/` answers with
  the page; the test then stops it.
- A Python block runs after a prelude that starts a gloo world of one process (the README says "after
  init_process_group"), and its trace file must be readable afterwards.
Skipped, with the reason shown by `pytest -rs`: torchrun over several nodes (needs another host), and commands
that need a CUDA GPU when none is present. `make ...` lines are not megatronapp commands and are only listed.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatronapp.config import TraceConfig
from megatronapp.launch import free_port

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"
MEGATRONAPP = Path(sys.executable).parent / "megatronapp"  # the console script of this interpreter's venv
COMMAND_TIMEOUT_S = 600  # generous: a loaded 2-core machine runs an 8-rank job for minutes
SHELL_LANGS = ("", "sh", "bash", "shell", "console")


@dataclass
class Entry:
    """One runnable thing found in the README."""

    text: str  # the command line (continuations joined, comment stripped) or the Python source
    kind: str  # "megatronapp" | "torchrun" | "python"
    skip: str | None = None  # why it is not run here


def fenced_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, body) of every ``` fenced block, in order."""
    return [(m.group(1).strip().lower(), m.group(2))
            for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", markdown, re.S | re.M)]


def shell_lines(body: str) -> list[str]:
    """Command lines of a shell block: backslash continuations joined, `# comments` and blanks dropped."""
    lines, current = [], ""
    for raw in body.splitlines():
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        words = shlex.split(current, comments=True)
        if words:
            lines.append(shlex.join(words))
        current = ""
    return lines


def skip_reason(words: list[str]) -> str | None:
    """Why a command cannot run on this machine, or None."""
    launcher = words[0] == "torchrun" or words[:2] == ["megatronapp", "torchrun"]
    if launcher and int((_value(words, "--nnodes") or "1").split(":")[0]) > 1:
        return "needs another host (torchrun --nnodes > 1)"
    needs_gpu = _value(words, "--device") == "cuda" or _value(words, "--backend") == "nccl"
    if needs_gpu and not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


def readme_entries(markdown: str) -> tuple[list[Entry], list[str], dict[str, str]]:
    """Runnable entries, the other (make) lines listed but not run, and named yaml files {name: text}."""
    entries: list[Entry] = []
    other: list[str] = []
    files: dict[str, str] = {}
    for lang, body in fenced_blocks(markdown):
        if lang == "python":
            entries.append(Entry(body, "python"))
        elif lang in ("yaml", "yml"):
            named = re.match(r"#\s*(\S+\.ya?ml)\b", body)
            if named:
                files[named.group(1)] = body
        elif lang in SHELL_LANGS:
            for line in shell_lines(body):
                words = shlex.split(line)
                if words[0] in ("megatronapp", "torchrun"):
                    entries.append(Entry(line, words[0], skip_reason(words)))
                elif words[0] == "make":
                    other.append(line)
                else:  # a new kind of command: decide here how to run it, do not let it pass unseen
                    raise AssertionError(f"README command of an unknown kind (teach {__name__} to run it): {line}")
    return entries, other, files


def _value(words: list[str], flag: str) -> str | None:
    """The value after `flag` in an argument list (last occurrence), or None."""
    found = None
    for i, w in enumerate(words[:-1]):
        if w == flag:
            found = words[i + 1]
    return found


def with_small_steps(words: list[str]) -> list[str]:
    """`megatronapp train` with a small --steps (see the module docstring for the values and why)."""
    if words[:2] != ["megatronapp", "train"]:
        return words
    if "--resume" in words:
        steps = 4
    elif "--trace" in words:
        steps = int(_value(words, "--trace-interval") or TraceConfig().interval)
    else:
        steps = 2
    out = list(words)
    if "--steps" in out:
        out[out.index("--steps") + 1] = str(steps)
    else:
        out += ["--steps", str(steps)]
    return out


ENTRIES, OTHER_LINES, YAML_FILES = readme_entries(README.read_text())


def _short(e: Entry) -> str:
    return e.text if e.kind != "python" else "python: " + e.text.strip().splitlines()[0]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{MEGATRONAPP.parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"  # scope serve's URL line must reach us while it runs
    return env


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process this test started, and the ranks it spawned (its own session's process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=15)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _failed(what: str, rc: int | None, out: str, err: str) -> str:
    return (f"README command failed (exit {rc}): {what}\n--- stderr (tail) ---\n{_tail(err)}"
            f"\n--- stdout (tail) ---\n{_tail(out, 10)}")


def run_command(argv: list[str], cwd: Path, timeout: float = COMMAND_TIMEOUT_S) -> tuple[int, str, str]:
    """Run to completion in its own session (so a timeout stops its spawned ranks too)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        out, err = proc.communicate()
        err += f"\n(timed out after {timeout:.0f} s)"
        return 124, out, err
    return proc.returncode, out, err


def run_server(argv: list[str], cwd: Path, timeout: float = 120) -> str:
    """Start a server, wait for the URL it prints, fetch the page, stop it; returns the page."""
    log_out, log_err = cwd / ".serve.out", cwd / ".serve.err"
    with open(log_out, "w") as fo, open(log_err, "w") as fe:
        proc = subprocess.Popen(argv, cwd=cwd, env=_env(), stdout=fo, stderr=fe, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None:
            found = re.search(r"http://\S+", log_out.read_text())
            url = found.group(0) if found else None
            if url is None and (proc.poll() is not None or time.monotonic() > deadline):
                state = f"exit {proc.returncode}" if proc.poll() is not None else f"no URL after {timeout:.0f} s"
                pytest.fail(_failed(shlex.join(argv), state, log_out.read_text(), log_err.read_text()))
            time.sleep(0.2)
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert resp.status == 200, f"{shlex.join(argv)}: GET {url} answered {resp.status}"
            return resp.read().decode("utf-8", "replace")
    finally:
        _stop(proc)


def _write_tiny_llama(d: Path) -> None:
    """A random 2-layer Llama in Hugging Face format (config.json + safetensors) and a small tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                                         tie_word_embeddings=False))
    model.save_pretrained(d)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sees the dog", "after monday comes tuesday"] * 10,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    tok.save(str(d / "tokenizer.json"))


# README placeholder -> how the test makes it (paths are relative to the shared working directory)
PLACEHOLDERS = {"path/to/llama-dir": _write_tiny_llama}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The directory every README command runs in, with the fixtures the README assumes."""
    assert MEGATRONAPP.is_file(), f"{MEGATRONAPP} missing: install the package into this venv (make test does)"
    d = tmp_path_factory.mktemp("readme")
    for name, text in YAML_FILES.items():
        (d / name).write_text(text)
    text = README.read_text()
    for placeholder, make in PLACEHOLDERS.items():
        if placeholder in text:
            (d / placeholder).mkdir(parents=True)
            make(d / placeholder)
    return d


PYTHON_PRELUDE = """\
import os
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
"""


def run_python(source: str, cwd: Path) -> None:
    """A README Python block in a one-process gloo world; its trace files must be readable afterwards."""
    from megatronapp.scan.read.format import read_rank

    cwd.mkdir(exist_ok=True)  # its own directory: the snippet's runs/t must not replace the training trace
    script = PYTHON_PRELUDE.format(port=free_port()) + textwrap.dedent(source) + "\ndist.destroy_process_group()\n"
    rc, out, err = run_command([sys.executable, "-c", script], cwd)
    if rc != 0:
        pytest.fail(_failed("README python block:\n" + source, rc, out, err))
    traces = sorted(cwd.rglob("rank*.mst"))
    assert traces, f"README python block wrote no trace file under {cwd}"
    for path in traces:
        assert len(read_rank(path)) > 0, f"{path}: no spans recorded by the README python block"


@pytest.mark.parametrize("entry", ENTRIES, ids=[_short(e)[:80] for e in ENTRIES])
def test_readme_command(entry: Entry, workdir: Path) -> None:
    if entry.skip:
        pytest.skip(f"{entry.text}: {entry.skip}")
    if entry.kind == "python":
        run_python(entry.text, workdir / f"python{ENTRIES.index(entry)}")
        return
    words = shlex.split(entry.text)
    escaping = [w for w in words if w.startswith("/") or ".." in Path(w).parts]
    assert not escaping, f"{entry.text}: paths outside the working directory {escaping} (would not land in tmp)"
    argv = [str(MEGATRONAPP), *with_small_steps(words)[1:]]
    if words[1:3] == ["scope", "serve"]:
        page = run_server(argv, workdir)
        assert "MegaScope" in page, f"{entry.text}: the page at / is not MegaScope's"
        return
    rc, out, err = run_command(argv, workdir)
    if rc != 0:
        pytest.fail(_failed(shlex.join(argv), rc, out, err))


def test_readme_inventory() -> None:
    """Print what the README holds and what is skipped; every megatronapp command must run here on a CPU."""
    print("\nREADME commands:")
    for e in ENTRIES:
        print(f"  {'SKIP (' + e.skip + ')' if e.skip else 'RUN'}: {_short(e)}")
    for line in OTHER_LINES:
        print(f"  NOT RUN (a make target, not a megatronapp command): {line}")
    kinds = {e.kind for e in ENTRIES}
    assert {"megatronapp", "python"} <= kinds, f"README parsing found no commands of kinds {kinds}"
    skipped = [e for e in ENTRIES if e.skip]
    allowed = ("needs another host", "needs a CUDA GPU")
    assert all(e.skip.startswith(allowed) for e in skipped), [(e.text, e.skip) for e in skipped]
    if not torch.cuda.is_available():
        assert all(e.kind == "torchrun" or e.skip == "needs a CUDA GPU" for e in skipped)
    assert "my.yaml" in YAML_FILES, "README uses --config my.yaml: keep its example block (```yaml # my.yaml)"


def test_parsing_rules() -> None:
    """The extraction the cases rely on: continuations, comments, steps, skips."""
    block = "megatronapp train --out runs/a \\\n    --steps 50   # a comment\nmake demo   # x\n"
    assert shell_lines(block) == ["megatronapp train --out runs/a --steps 50", "make demo"]
    assert with_small_steps(["megatronapp", "train", "--steps", "50"])[-2:] == ["--steps", "2"]
    assert with_small_steps(["megatronapp", "train", "--resume", "x"])[-2:] == ["--steps", "4"]
    assert with_small_steps(["megatronapp", "train", "--trace", "--trace-interval", "5"])[-2:] == ["--steps", "5"]
    assert with_small_steps(["megatronapp", "scan", "detect", "runs/t"]) == ["megatronapp", "scan", "detect", "runs/t"]
    assert skip_reason(shlex.split("torchrun --nnodes 2 -m megatronapp train")) is not None
    assert skip_reason(shlex.split("torchrun --nnodes 1 -m megatronapp train")) is None
    md = "```\nmegatronapp scan detect runs/t\nfoo --bar\n```\n"
    with pytest.raises(AssertionError, match="unknown kind"):
        readme_entries(md)
