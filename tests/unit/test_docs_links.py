"""README.md and docs/: every relative link resolves, the README stays short, and its commands exist.

- Links and images in README.md and docs/*.md point at files in the repository; an anchor into a
  Markdown file names a heading there (as GitHub makes its id). Web and mail links are not fetched.
- README.md has at most 250 lines (issue 19): reference material lives in docs/.
- Every command in their ```bash blocks that starts with one of our console scripts, `make`,
  `python -m`, `pytest` or `bash SCRIPT` names something real: a [project.scripts] entry whose
  parser knows each --flag used, a Makefile target (read at test time), an importable module, an
  existing test path or script.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import shlex
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 250


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


# --- Markdown -----------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
HTML_REF = re.compile(r"<(?:a|img)\b[^>]*\b(?:href|src)=\"([^\"]+)\"", re.IGNORECASE)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def split_fences(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, line, language of the fenced block it is in, or None outside one); fence lines
    themselves are reported with language None and an empty line."""
    out: list[tuple[int, str, str | None]] = []
    fence: str | None = None
    language = ""
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence, language = match.group(1), match.group(2).lower()
            out.append((number, "", None))
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip(fence[0]).strip():
            fence = None
            out.append((number, "", None))
        else:
            out.append((number, line, language if fence is not None else None))
    return out


def prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code, with inline code spans removed (links are not links there)."""
    return [(n, INLINE_CODE.sub("", line)) for n, line, language in split_fences(text) if language is None]


def github_slug(heading: str) -> str:
    """The id GitHub gives a heading: link text kept, tags dropped, lowercase, punctuation removed,
    each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    ids = set()
    for _, line, language in split_fences(path.read_text(encoding="utf-8")):
        match = HEADING.match(line) if language is None else None
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        ids.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(ids)


def link_targets(text: str) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(text):
        found += [(number, m.group(1)) for m in INLINE_LINK.finditer(line)]
        found += [(number, m.group(1)) for m in HTML_REF.finditer(line)]
        match = REFERENCE_DEF.match(line)
        if match:
            found.append((number, match.group(1)))
    return found


def link_problems(md_path: Path, root: Path = ROOT) -> list[str]:
    """Every relative link or image of ``md_path`` that does not resolve, as 'file:line: why'."""
    problems = []
    name = md_path.relative_to(root) if md_path.is_relative_to(root) else md_path
    for number, target in link_targets(md_path.read_text(encoding="utf-8")):
        where = f"{name}:{number}: ({target})"
        if not target:
            problems.append(f"{where} empty link")
            continue
        if SCHEME.match(target) or target.startswith("//"):
            continue  # http(s), mailto, ...: not checked here
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part.split("?", 1)[0])
        if not path_part:
            resolved = md_path
        elif path_part.startswith("/"):
            resolved = root / path_part.lstrip("/")
        else:
            resolved = md_path.parent / path_part
        resolved = resolved.resolve()
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{where} points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where} no such file: {resolved.relative_to(root.resolve())}")
        elif (
            anchor
            and resolved.suffix.lower() == ".md"
            and resolved.is_file()
            and unquote(anchor).lower() not in anchors(resolved)
        ):
            problems.append(f"{where} no heading with id #{anchor} in {resolved.relative_to(root.resolve())}")
    return problems


# --- Commands -----------------------------------------------------------------------------------

SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
OPERATORS = {"&&", "||", ";", "|", "&", ";;", "(", ")"}


def bash_commands(text: str) -> list[tuple[int, str]]:
    """Logical lines of the bash blocks (continuations joined), with the number of their first line."""
    commands: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line, language in split_fences(text):
        if language not in SHELL_LANGUAGES:
            pending = None
            continue
        line = line.removeprefix("$ ") if language == "console" else line
        start, joined = pending if pending else (number, "")
        joined += line
        if joined.rstrip().endswith("\\"):
            pending = (start, joined.rstrip()[:-1] + " ")
            continue
        pending = None
        if joined.strip() and not joined.lstrip().startswith("#"):
            commands.append((start, joined.strip()))
    return commands


def simple_commands(line: str) -> list[list[str]]:
    """The words of each simple command of a shell line (split at && || ; | &), comments dropped,
    leading VAR=value assignments dropped. Raises ValueError on unbalanced quotes."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in OPERATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    words_list = []
    for words in commands:
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if words:
            words_list.append(words)
    return words_list


@functools.cache
def console_scripts(root: Path = ROOT) -> dict[str, str]:
    with (root / "pyproject.toml").open("rb") as f:
        return dict(tomllib.load(f)["project"].get("scripts", {}))


def make_targets(root: Path = ROOT) -> set[str]:
    """Rule targets of the Makefile, read now (targets other changes add count at once)."""
    targets = set()
    for line in (root / "Makefile").read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([^\s:#=][^:=]*?)\s*::?(?![=])", line)
        if match and not line.startswith("\t"):
            targets.update(t for t in match.group(1).split() if not t.startswith("."))
    return targets


@functools.cache
def script_options(entry_point: str) -> frozenset[str]:
    """Option strings of a console script's parser: the ``build_parser()`` of its entry point's module."""
    module_name, _, attribute = entry_point.partition(":")
    module = importlib.import_module(module_name)
    if attribute and not hasattr(module, attribute.split(".")[0]):
        raise LookupError(f"{entry_point}: {module_name} has no {attribute}")
    if not hasattr(module, "build_parser"):
        raise LookupError(f"{module_name} has no build_parser() to read the flags from")
    return frozenset(module.build_parser()._option_string_actions)


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def command_problems(text: str, name: str, root: Path = ROOT) -> list[str]:
    """What is wrong with the bash-block commands of a Markdown text, as 'name:line: why'."""
    problems = []
    scripts = console_scripts(root)
    targets = make_targets(root)
    for number, line in bash_commands(text):
        where = f"{name}:{number}: ({line})"
        try:
            commands = simple_commands(line)
        except ValueError as exc:
            if any(s in line for s in [*scripts, "make ", "python"]):
                problems.append(f"{where} cannot be parsed: {exc}")
            continue
        for words in commands:
            program = words[0].removeprefix(".venv/bin/")
            args = words[1:]
            if program in scripts or re.match(r"^(vision|compile)-[a-z-]+$", program):
                if program not in scripts:
                    problems.append(f"{where} {program} is not a console script of pyproject.toml")
                    continue
                try:
                    options = script_options(scripts[program])
                except (ImportError, LookupError) as exc:
                    problems.append(f"{where} cannot read {program}'s flags: {exc}")
                    continue
                for arg in args:
                    if arg == "--":
                        break
                    flag = arg.split("=", 1)[0]
                    if re.match(r"^--?[A-Za-z]", flag) and flag not in options:
                        problems.append(f"{where} {program} has no flag {flag}")
            elif program == "make":
                for arg in args:
                    if not arg.startswith("-") and "=" not in arg and arg not in targets:
                        problems.append(f"{where} the Makefile has no target {arg!r}")
            elif re.match(r"^python(3(\.\d+)?)?$", program) and "-m" in args[:-1]:
                module = args[args.index("-m") + 1]
                if not module_exists(module):
                    problems.append(f"{where} no module {module}")
                elif module == "pytest":
                    problems += missing_test_paths(args[args.index("-m") + 2 :], where, root)
            elif program == "pytest":
                problems += missing_test_paths(args, where, root)
            elif program in ("bash", "sh") and args and not args[0].startswith("-") and not (root / args[0]).is_file():
                problems.append(f"{where} no script {args[0]}")
    return problems


def missing_test_paths(args: list[str], where: str, root: Path) -> list[str]:
    """pytest's path arguments (tests/..., *.py, node ids) that do not exist."""
    paths = [
        a.split("::", 1)[0] for a in args if not a.startswith("-") and (a.startswith("tests") or a.endswith(".py"))
    ]
    return [f"{where} no test path {p}" for p in paths if not (root / p).exists()]


# --- The checks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("md", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md):
    assert link_problems(md) == []


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material to docs/"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in link_targets(README.read_text())}
    missing = [str(p.relative_to(ROOT)) for p in doc_files()[1:] if p.resolve() not in linked]
    assert missing == [], f"README.md does not link {missing}"


@pytest.mark.parametrize("md", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_in_bash_blocks_exist(md):
    assert command_problems(md.read_text(encoding="utf-8"), str(md.relative_to(ROOT))) == []


def test_readme_shows_the_two_setup_commands():
    commands = [line.split("#")[0].strip() for _, line in bash_commands(README.read_text(encoding="utf-8"))]
    assert "make demo" in commands and "make test" in commands


# --- The checkers catch what they should --------------------------------------------------------


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("`POST /predict`", "post-predict"),
        ("`GET /`: the upload page", "get--the-upload-page"),
        ("Compiling (`compile-trt`), models and weights", "compiling-compile-trt-models-and-weights"),
        ("Overload, deadlines, crashes", "overload-deadlines-crashes"),
        ("KServe v2 / Triton, HTTP and gRPC", "kserve-v2--triton-http-and-grpc"),
        ("The [`pil`](x.md) backend", "the-pil-backend"),
    ],
)
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_link_checker_flags_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ok.md").write_text("# Title\n\n## Real heading\n\n## Real heading\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[gone](missing.md) [bad anchor](ok.md#nope) [good](ok.md#real-heading) [dup](ok.md#real-heading-1)\n"
        "![img](img/none.png) [web](https://example.com/x) [mail](mailto:a@b.c) [self](#here) [top](#title-x)\n"
        "[out](../../elsewhere.md) `[code](not-checked.md)`\n\n"
        "```text\n[fenced](not-checked-either.md)\n```\n\n"
        "## Here\n\n[ref]: ../docs/missing-ref.md\n"
    )
    problems = link_problems(page, tmp_path)
    assert len(problems) == 6, problems
    for part in ("missing.md", "#nope", "img/none.png", "#title-x", "outside the repository", "missing-ref.md"):
        assert sum(part in p for p in problems) == 1, (part, problems)


def test_command_checker_flags_missing_commands():
    text = (
        "```bash\n"
        "vision-serve --model efficientnet-lite0 --no-such-flag 1   # a flag the parser lacks\n"
        "compile-trt --model resnet152 --precision fp16 --batch 1,16,64\n"
        "vision-classify a.jpg --top-k 3 && vision-nope --x\n"
        "make demo no-such-target VENV=/tmp/v\n"
        "python -m benchmarks.no_such_module \\\n    --flag\n"
        "VISION_SERVE_PORT=9 .venv/bin/pytest tests/no_such_test.py -k oip\n"
        "bash benchmarks/no_such.sh phase\n"
        "curl --anything http://x  # not ours: not checked\n"
        "```\n"
    )
    problems = command_problems(text, "t.md")
    expected = ["--no-such-flag", "vision-nope", "'no-such-target'", "no_such_module", "no_such_test.py", "no_such.sh"]
    assert len(problems) == len(expected), problems
    for part in expected:
        assert sum(part in p for p in problems) == 1, (part, problems)
    assert problems[3].startswith("t.md:6: "), problems  # line 1 is the fence


PROCESS_WORDS = ("main process", "HTTP process", "worker", "caller's process")


def test_each_service_subpackage_says_which_process_runs_it() -> None:
    """The tree shows which code runs where: every subpackage of service/ opens by naming its process."""
    root = Path(__file__).resolve().parents[2] / "service"
    packages = sorted(p.parent.relative_to(root.parent) for p in root.glob("**/*/__init__.py"))
    names = {".".join(p.parts) for p in packages}
    assert names >= {"service.supervisor", "service.http", "service.http.oip", "service.client", "service.worker"}
    for name in sorted(names):
        doc = importlib.import_module(name).__doc__ or ""
        assert any(word in doc for word in PROCESS_WORDS), f"{name.replace('.', '/')}/__init__.py names no process"
