"""The docs keep to the code: the site builds with warnings as errors (a broken link or anchor, a page left
out of the nav), every ``probe`` command line in the shell blocks of README.md and docs/*.md parses against
the real command line (its command, subcommand, options and arguments, by click's own parser), and the
commands a reader tries first run against a real process and succeed."""

import glob
import os
import re
import shlex
import subprocess
import sys
from typing import Iterator, List, Tuple

import click
import pytest

from procs import REPO, run_cli, scaled

from probe.cli.app import normalise_argv
from probe.cli.group import cli

PAGES = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
_SHELL = {"", "sh", "bash", "shell", "console"}
_STARTS = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*probe\s|\|\s*probe\s")
_OPERATORS = {"|", "||", "&&", ";", "&"}
_METAVARS = {"N": "1000"}  # a usage line's placeholder for a number (``--every N``), as a reader fills it in


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    """mkdocs.yml sets strict and turns link, anchor and nav checks into warnings; nothing is fetched (no web
    fonts, no social cards), so the build runs offline."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", os.path.join(REPO, "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, cwd=REPO,
                          timeout=scaled(120), env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    built = {os.path.relpath(p, tmp_path / "site") for p in glob.glob(str(tmp_path / "site" / "**" / "index.html"),
                                                                        recursive=True)}
    for page in glob.glob(os.path.join(REPO, "docs", "*.md")):
        name = os.path.basename(page)[:-3]
        assert ("index.html" if name == "index" else name + "/index.html") in built, name


def test_the_readme_is_a_front_page_that_names_what_the_test_command_installs():
    """README.md stays a front page (the manual is docs/), and names every package tests/run.sh installs with
    apt, so that whoever runs it on their machine knows beforehand."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        readme = handle.read()
    assert len(readme.splitlines()) <= 300, len(readme.splitlines())
    assert "pip install -e . && python examples/demo.py" in readme and "bash tests/run.sh" in readme
    with open(os.path.join(REPO, "tests", "run.sh"), encoding="utf-8") as handle:
        installed = {p for line in re.findall(r"apt-get install -y -qq ([^>)|\\\n]+)", handle.read()) for p in line.split()}
    assert {"gdb", "chromium", "chromium-driver", "firefox-esr"} <= installed, installed
    assert not [p for p in installed if p not in readme], sorted(p for p in installed if p not in readme)


def test_the_site_home_is_the_readme():
    """docs/index.md is README.md with its links made the site's own (docs/x.md -> x.md): edit both alike."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        readme = handle.read()
    with open(os.path.join(REPO, "docs", "index.md"), encoding="utf-8") as handle:
        home = handle.read()
    readme = readme.replace("The manual is in [`docs/`](docs/index.md), a page per task; build it",
                            "This site is the manual, a page per task; build it")
    assert home == readme.replace("](docs/", "]("), "docs/index.md and README.md differ beyond their links"


def _shell_blocks(path: str) -> Iterator[Tuple[int, List[str]]]:
    """(line number, lines) of each fenced block whose info string names a shell, or none."""
    lines = open(path, encoding="utf-8").read().split("\n")
    start, info = None, ""
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            if start is None:
                start, info = number, line[3:].strip()
            else:
                if info in _SHELL:
                    yield start + 1, lines[start:number - 1]
                start = None


def _words(text: str) -> Tuple[List[str], bool]:
    """The shell words of ``text`` as a reader meant them, and whether it is complete (no quote left open, no
    trailing backslash). Comments go; a usage line's ``[--every N]`` is the option itself, ``[A | B]`` its first
    alternative, ``<node 0's address>`` a placeholder word."""
    out, quote, groups, i = [], "", [], 0
    while i < len(text):
        c = text[i]
        if quote:
            out.append(c)
            if c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
            out.append(c)
        elif c == "#" and (i == 0 or text[i - 1].isspace()):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif c == "<" and i + 1 < len(text) and text[i + 1].isalpha() and ">" in text[i:text.find("\n", i) % (len(text) + 1)]:
            i = text.index(">", i) + 1
            out.append("PLACEHOLDER")
            continue
        elif c == "[" and (i == 0 or text[i - 1].isspace()):
            groups.append(i)
        elif c == "|" and groups:
            i = text.index("]", i)  # the alternatives after the first
            continue
        elif c == "]" and groups:
            groups.pop()
        else:
            out.append(c)
        i += 1
    joined = "".join(out).replace("\\\n", " ")
    if quote or joined.rstrip().endswith("\\"):
        return [], False
    return shlex.split(joined), True


def doc_commands() -> Iterator[Tuple[str, str, List[str]]]:
    """(where, the line as written, argv after ``probe``) of every probe command in the docs' shell blocks."""
    for path in PAGES:
        for first, lines in _shell_blocks(path):
            i = 0
            while i < len(lines):
                if not _STARTS.search(lines[i]):
                    i += 1
                    continue
                text, j = lines[i], i + 1
                words, complete = _words(text)
                while not complete and j < len(lines):
                    text += "\n" + lines[j]
                    j += 1
                    words, complete = _words(text)
                assert complete, "%s:%d: a command with an open quote: %s" % (path, first + i, text)
                where = "%s:%d" % (os.path.relpath(path, REPO), first + i)
                start = max(k for k, w in enumerate(words) if w == "probe" and (k == 0 or "=" in words[k - 1]
                                                                               or words[k - 1] in _OPERATORS))
                argv = words[start + 1:]
                argv = argv[:next((k for k, w in enumerate(argv) if w in _OPERATORS), len(argv))]
                yield where, text, argv
                i = j


def _parse(argv: List[str]) -> str:
    """Parse ``argv`` as ``probe`` would, with click's own parser on the real group and each command it names,
    running none of them. Returns the command path; raises click's UsageError where it does not parse."""
    args = normalise_argv([_METAVARS.get(a, a) for a in argv])
    ctx = cli.make_context("probe", args)
    command: click.Command = cli
    path = []
    while isinstance(command, click.Group):
        protected = getattr(ctx, "_protected_args", None)  # click 8.2 and later; 8.1 calls it protected_args
        rest = list(ctx.protected_args if protected is None else protected) + list(ctx.args)
        assert rest, "no command in %r" % argv
        name, sub, rest = command.resolve_command(ctx, rest)
        assert sub is not None and name is not None
        path.append(name)
        ctx = sub.make_context(name, rest, parent=ctx)
        command = sub
    return " ".join(path)


def test_every_command_in_the_docs_parses_against_the_real_command_line():
    commands = list(doc_commands())
    assert len(commands) > 100, len(commands)  # the extraction finds them (README and docs hold some 110)
    wrong, seen = [], set()
    for where, text, argv in commands:
        try:
            seen.add(_parse(argv).split(" ")[0])
        except (click.UsageError, click.BadParameter, AssertionError) as error:
            wrong.append("%s: %s\n    %s" % (where, text.strip(), getattr(error, "message", error)))
    assert not wrong, "commands in the docs that probe does not take:\n" + "\n".join(wrong)
    from probe.cli.app import COMMANDS

    assert set(COMMANDS) <= seen, "commands with no example in a shell block: %s" % sorted(set(COMMANDS) - seen)


def test_a_misspelt_option_in_a_doc_command_would_be_caught():
    """The check above is no rubber stamp: an option, a command or a subcommand that is not there fails."""
    for argv in (["4242", "backtrace", "--jsn"], ["4242", "backtrac"], ["4242", "trace", "begin"],
                 ["4242", "query"], ["4242", "eval", "--on", "somewhere", "1"]):
        with pytest.raises(click.UsageError):
            _parse(argv)


#: Commands of the docs that a reader runs first, run as written against a live process (tests/targets/idle.py),
#: where ``$PID`` is its pid: each must exit 0, and what it prints must come from that process.
LIVE = {
    "probe list": "idle.py",
    "probe $PID backtrace": "main_sleep",
    "probe $PID backtrace --json": '"func": "main_sleep"',
    'probe $PID query "SELECT func, file, lineno, depth FROM python.backtrace ORDER BY depth LIMIT 10"': "main_sleep",
    'probe $PID query "SELECT thread_name, count(*) FROM python.backtrace GROUP BY 1" --json': '"loader-0"',
    'probe $PID query "SELECT * FROM process.info" -x': "idle.py",
    'probe $PID query "SELECT func, lineno FROM python.backtrace WHERE depth = 0"': "main_sleep",
    'probe $PID eval "import threading; print([t.name for t in threading.enumerate()])"': "'heartbeat'",
    "probe $PID tables": "python.backtrace",
    "probe $PID schema python.backtrace": "lineno",
    "probe $PID health": "pid",
}


def test_the_first_commands_a_reader_tries_run_as_written(idle_target):
    written = {re.sub(r"\s+", " ", " ".join(["probe"] + [shlex.quote(a) if " " in a else a for a in argv]))
               for _, _, argv in doc_commands()}
    pid = str(idle_target.pid)
    wrong = []
    for line, expected in LIVE.items():
        argv = shlex.split(line)[1:]
        assert " ".join(["probe"] + [shlex.quote(a) if " " in a else a for a in argv]) in written, \
            "no longer in the docs: %s" % line
        done = run_cli(*[pid if a == "$PID" else a for a in argv], timeout=scaled(60))
        if done.code != 0 or expected not in done.out:
            wrong.append("%s: exit %d, %r not in its output:\n%s%s" % (line, done.code, expected, done.out[-800:],
                                                                        done.err[-800:]))
    assert not wrong, "\n".join(wrong)
