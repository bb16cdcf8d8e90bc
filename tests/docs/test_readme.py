"""The README's and the docs' examples cannot rot: every ```python block runs, every ``speculant ...`` command line
parses, every relative link and every ``src/speculant/...`` or ``benchmarks/...`` path they name exists, and the
help and the docs name every KV policy.

The pages are README.md, docs/*.md and docs/results/*.md (:data:`PAGES`). Each Python block runs as written in a
fresh interpreter (with a timeout), after the placeholders of :data:`PLACEHOLDERS` are replaced:
``path/to/target`` and ``path/to/draft`` become the bundled pair (``default-target`` / ``default-draft``), so
those blocks run in the default suite. A block that names a packaged model (SmolLM2, the Qwen pair) is slow and
runs only when that model's package is installed (skipped with the reason otherwise); a block that talks to a
server (``OpenAI(base_url=...)``) gets a ``speculant serve`` of the model it names, on a free port. The command
lines of every other block (unlabelled, ``bash``, ``sh``, ``console`` or ``shell``) are parsed by the CLI's own
parser, which declares each subcommand's options and converts them, without running anything.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import start_server, stop_server
from speculant import cli
from speculant.commands.common import UsageError
from speculant.models.loading import bundled_dir
from speculant.models.sources import PACKAGED, packaged_installed


def _root() -> Path:
    """The repository root: the nearest folder above this file that holds pyproject.toml."""
    for folder in Path(__file__).resolve().parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    raise AssertionError("no pyproject.toml above the tests")


ROOT = _root()
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "results").glob("*.md"))]
"""Every page whose examples, links and paths are checked."""
PLACEHOLDERS = {"path/to/target": "default-target", "path/to/draft": "default-draft"}
"""Placeholder paths of the pages' Python blocks -> the bundled models that stand in for them."""
SHELL = {"", "bash", "sh", "console", "shell"}
FENCE = re.compile(r"^```(\S*)\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w/.:-])((?:src/speculant|benchmarks)(?:/(?:[\w.+*-]|\{[\w.,+*-]*\})+)*/?)")
"""A path of the repository named in a page: ``src/speculant/...`` or ``benchmarks/...`` (``*`` and ``{a,b}``
allowed: every alternative must exist, a pattern must match something). A path right after a colon is a file of an
earlier commit (``git show COMMIT:benchmarks/old.py``), which the working tree need not hold."""


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    text: str
    page: str = "README.md"

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The fenced code blocks of ``text`` (a fence is a line of ```` ``` ```` with an optional language)."""
    blocks, open_at, lang, body = [], None, "", []
    for n, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if open_at is None and match:
            open_at, lang, body = n, match.group(1), []
        elif open_at is not None and line.rstrip() == "```":
            blocks.append(Block(lang, open_at, "\n".join(body) + "\n", page))
            open_at = None
        elif open_at is not None:
            body.append(line)
    assert open_at is None, f"{page}:{open_at}: a code block is never closed"
    return blocks


def command_lines(block: str) -> list[list[str]]:
    """The ``speculant ...`` commands of a shell block as argv lists (continuations joined, comments and a
    trailing ``...`` (\"more options\") dropped; a command after a pipe counts too)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"^.*\|\s*(?=speculant )", "", line)
        if line.startswith("speculant "):
            out.append([a for a in shlex.split(line, comments=True)[1:] if a != "..."])
    return out


TEXTS = {_rel(page): page.read_text(encoding="utf-8") for page in PAGES}
BLOCKS = [b for page, text in TEXTS.items() for b in readme_blocks(text, page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
COMMANDS = [(b, argv) for b in BLOCKS if b.lang in SHELL for argv in command_lines(b.text)]


def test_the_pages_have_examples():
    """The collection itself can fail: a changed fence style must not leave these tests with nothing to run."""
    assert "docs/README.md" in TEXTS and len(TEXTS) >= 10, sorted(TEXTS)
    in_readme = [b for b in PYTHON if b.page == "README.md"]
    assert len(in_readme) >= 2 and len(PYTHON) >= 8 and len(COMMANDS) >= 30, (len(in_readme), len(PYTHON),
                                                                                len(COMMANDS))
    fast = [b for b in PYTHON if not _packaged_names(b.text)]
    assert len(fast) >= 4, "the default suite must run some Python blocks (on the bundled pair)"
    assert readme_blocks("a\n```python\nx = 1\n```\n```\nspeculant generate hi \\\n  --k 2 ...\n```\n") == [
        Block("python", 2, "x = 1\n"), Block("", 5, "speculant generate hi \\\n  --k 2 ...\n")]
    lines = command_lines("make demo\nspeculant generate hi \\\n  --k 2 ...   # more\necho a | speculant generate -\n")
    assert lines == [["generate", "hi", "--k", "2"], ["generate", "-"]]


def test_the_readme_is_short():
    """README.md is the product's front page; the manual is docs/."""
    assert len(TEXTS["README.md"].splitlines()) <= 250


# ---------------------------------------------------------------------------------------------- Python blocks


def _packaged_names(code: str) -> list[str]:
    """The packaged models a block names (longest first, so a name inside another is not counted twice)."""
    names, rest = [], code
    for name in sorted(PACKAGED, key=len, reverse=True):
        if name in rest:
            names.append(name)
            rest = rest.replace(name, "")
    return names


def _packaged_missing(code: str) -> str | None:
    for name in _packaged_names(code):
        if not packaged_installed(name):
            return f"{name} is not installed: {PACKAGED[name].install_hint()}"
    return None


def _python_param(block: Block):
    marks = [pytest.mark.slow] if _packaged_names(block.text) else []
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_python_param(b) for b in PYTHON])
def test_python_block_runs(block, tmp_path):
    code = block.text
    for placeholder, name in PLACEHOLDERS.items():
        if placeholder in code:
            path = bundled_dir(name)
            assert path is not None, f"the bundled {name} is missing from this checkout"
            code = code.replace(placeholder, str(path))
    assert "path/to/" not in code, f"{block.id}: a placeholder path with no stand-in in PLACEHOLDERS"
    if reason := _packaged_missing(code):
        pytest.skip(reason)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(cli.__file__).parent.parent), os.environ.get("PYTHONPATH")) if p)}
    server = None
    try:
        if "OpenAI(" in code:  # a client example: serve the model it names, on a free port
            url = re.search(r'base_url="(http://[^"]+)/v1"', code)
            model = re.search(r'model="([^"]+)"', code)
            assert url and model, f"{block.id}: no base_url / model to serve"
            server, served = start_server(["--target", model.group(1)], tmp_path / "serve.log", env=env,
                                          ready=True)
            code = code.replace(url.group(1), served)
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, text=True, timeout=600,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        if server is not None:
            stop_server(server)
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{block.id} printed nothing"


# ---------------------------------------------------------------------------------------------- command lines


def _parse(argv: list[str]):
    """Parse ``speculant ARGV`` as :func:`speculant.cli.main` would, without running it."""
    bench_serve = cli._bench_serve_argv(argv)
    parser = cli._bench_serve_parser() if bench_serve is not None else cli.build_parser()
    try:
        return parser.parse_args(bench_serve if bench_serve is not None else argv)
    except SystemExit as exc:  # --help
        assert exc.code in (0, None), exc
        return None


@pytest.mark.parametrize("block,argv", [pytest.param(b, a, id=f"{b.id}:{a[0]}") for b, a in COMMANDS])
def test_command_line_parses(block, argv, capsys):
    try:
        args = _parse(argv)
    except UsageError as exc:
        pytest.fail(f"{block.id}: `speculant {shlex.join(argv)}` does not parse: {exc}")
    assert args is None or callable(args.run)


def test_a_wrong_command_line_fails_to_parse(capsys):
    """The check above can fail."""
    with pytest.raises(UsageError, match="--no-such-option"):
        _parse(["generate", "hi", "--no-such-option"])
    with pytest.raises(UsageError):
        _parse(["bench", "--temperature", "warm"])


# ---------------------------------------------------------------------------------------------- links and paths


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def _links(page: str) -> list[str]:
    return [m.group(1) for m in LINK.finditer(TEXTS[page])]


@pytest.mark.parametrize("page", sorted(TEXTS))
def test_relative_links_resolve(page):
    """Every relative link (and image) of a page points at a file or folder of the repository, and a link to
    ``#heading`` at a heading of its page."""
    base = (ROOT / page).parent
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (base / path).resolve() if path else ROOT / page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text(encoding="utf-8")):
            broken.append(target)
    assert not broken, f"{page}: broken links {broken}"


def _expand(path: str) -> list[str]:
    """``a/{b,c}.json`` -> ``["a/b.json", "a/c.json"]`` (the first brace group, recursively)."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    return [x for alt in match.group(1).split(",")
            for x in _expand(path[:match.start()] + alt + path[match.end():])]


def _exists(path: str) -> bool:
    return any(ROOT.glob(path.rstrip("/"))) if "*" in path else (ROOT / path).exists()


@pytest.mark.parametrize("page", sorted(TEXTS))
def test_named_paths_exist(page):
    """Every ``src/speculant/...`` and ``benchmarks/...`` path a page names (in prose or in a command) exists."""
    named = {p for m in PATH.finditer(TEXTS[page]) for p in _expand(m.group(1).rstrip(".,"))}
    missing = sorted(p for p in named if not _exists(p))
    assert not missing, f"{page}: paths that do not exist: {missing}"


def test_the_link_and_path_checks_can_fail(tmp_path):
    assert [m.group(1) for m in LINK.finditer("see [a](docs/a.md#x) and ![b](img.png) [c](http://x)")] == [
        "docs/a.md#x", "img.png", "http://x"]
    assert [m.group(1) for m in PATH.finditer("`src/speculant/core/engine.py`, benchmarks/results/bench.")] == [
        "src/speculant/core/engine.py", "benchmarks/results/bench."]
    assert [m.group(1) for m in PATH.finditer("--results benchmarks/a.json,benchmarks/b.{json,md}")] == [
        "benchmarks/a.json", "benchmarks/b.{json,md}"]
    assert _expand("benchmarks/results/tree_budget.{json,png}") == [
        "benchmarks/results/tree_budget.json", "benchmarks/results/tree_budget.png"]
    assert _exists("benchmarks/results/qwen-mtbench-*") and not _exists("benchmarks/results/no-such-*")
    assert not _exists("src/speculant/no_such_module.py")
    assert _slug("Weight formats") == "weight-formats" and _slug("`speculant train draft`: a drafter") == (
        "speculant-train-draft-a-drafter")


def test_no_history_in_the_pages():
    """The pages describe the product; run history lives in git and in the dated results pages' own sources."""
    pattern = re.compile(r"session [0-9]|issue [0-9]|item [0-9]|\.\./shared", re.I)
    found = [(page, m.group(0)) for page, text in TEXTS.items() if not page.startswith("docs/results/")
             for m in pattern.finditer(text)]
    assert not found, found


# ---------------------------------------------------------------------------------------------- prose


def test_help_and_docs_list_every_kv_policy():
    """generate --help and the methods catalogue name every policy of the KV registry (no drift between them)."""
    from speculant.kv.registry import POLICIES, WRAPPERS

    sub = cli.build_parser(eager=True)._subparsers._group_actions[0].choices["generate"]
    help_text = " ".join(sub.format_help().split())
    catalogue = TEXTS["docs/methods.md"]
    for name in [*POLICIES, *WRAPPERS]:
        assert name in help_text, name
        assert f"`{name}" in catalogue, name


def test_the_catalogue_lists_every_method():
    """docs/methods.md has a row for every drafting method of the registry."""
    from speculant.drafters.registry import methods

    catalogue = TEXTS["docs/methods.md"]
    missing = [name for name in methods() if f"| `{name}" not in catalogue]
    assert not missing, missing
