"""The docs name only what exists: every `eyas COMMAND` and its flags, every `eyas.module.name`, every repository path.

Read from README.md, BENCHMARKS.md and docs/*.md (benchmarks/LOG.md and benchmarks/log/ are history: they name what
existed then). In code
(inline spans and fenced blocks) a line, or a part after `&&`, `;` or `|`, that starts with `eyas COMMAND` (or
`python -m eyas COMMAND`, `$ eyas …`) must name a command of the CLI, and every `--flag` after it on that part (shell
comments dropped) one of that command's flags. A dotted `eyas.…` name must be a module, or a name in the longest module
it starts with. A path under src/eyas/, benchmarks/, tests/, docs/ or releases/ must exist (wildcards and placeholders
aside).
"""

import importlib
import importlib.util
import re
from pathlib import Path

import typer.main

from eyas.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
SPAN = re.compile(r"```.*?```|`[^`\n]+`", re.S)
COMMAND = re.compile(r"^\s*(?:\$\s*)?(?:python3? -m )?eyas ([a-z][a-z-]*)(.*)$")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
DOTTED = re.compile(r"(?<![\w/.])eyas(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/.-])((?:src/eyas|benchmarks|tests|docs|releases)/[\w./-]*\w)")
GLOBAL_FLAGS = {"--debug", "--help"}


def cli_flags() -> dict[str, set[str]]:
    group = typer.main.get_command(app)
    return {name: {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} for name, cmd in group.commands.items()}


def code_parts(text: str):
    """(line number, one shell command's text) for every command part of every code span of ``text``."""
    for span in SPAN.finditer(text):
        first = text.count("\n", 0, span.start()) + 1
        for offset, line in enumerate(span.group(0).strip("`").splitlines()):
            line = re.sub(r"\s#.*$", "", line)  # a shell comment
            for part in re.split(r"&&|;|\|(?!\|)", line):
                yield first + offset, part


def command_problems(doc: Path, commands: dict[str, set[str]]) -> list[str]:
    problems = []
    for line, part in code_parts(doc.read_text()):
        found = COMMAND.match(part)
        if not found:
            continue
        name, rest = found.groups()
        if name not in commands:
            problems.append(f"{doc.name}:{line}: `eyas {name}`: no such command")
            continue
        problems += [f"{doc.name}:{line}: `eyas {name} {flag}`: no such flag"
                     for flag in FLAG.findall(rest) if flag not in commands[name] | GLOBAL_FLAGS]
    return problems


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:i]))
        except ModuleNotFoundError:  # a name inside a module, asked as a submodule
            spec = None
        if spec is None:
            continue
        thing = importlib.import_module(".".join(parts[:i]))
        for name in parts[i:]:
            if not hasattr(thing, name):
                return False
            thing = getattr(thing, name)
        return True
    return False


def name_problems(doc: Path) -> list[str]:
    text, problems = doc.read_text(), []
    for span in SPAN.finditer(text):
        line = text.count("\n", 0, span.start()) + 1
        problems += [f"{doc.name}:{line}: `{dotted}`: no such module or name"
                     for dotted in DOTTED.findall(span.group(0)) if not resolves(dotted)]
    for found in PATH.finditer(text):
        path = found.group(1).rstrip(".")
        if not any(c in path for c in "*<>{}") and not (ROOT / path).exists():
            problems.append(f"{doc.name}:{text.count(chr(10), 0, found.start()) + 1}: {path}: no such path")
    return problems


def test_the_docs_name_only_commands_flags_modules_and_paths_that_exist():
    commands = cli_flags()
    problems = [p for doc in DOCS for p in command_problems(doc, commands) + name_problems(doc)]
    assert not problems, "the docs name what does not exist:\n" + "\n".join(problems)


def test_the_check_finds_what_does_not_exist(tmp_path):
    """The scanner itself: a made-up command, flag, module and path are each reported; real ones are not."""
    doc = tmp_path / "doc.md"
    doc.write_text("Run `eyas bench --target T --prompts 5` or `eyas bench --no-such-flag`, then `eyas teleport`.\n"
                   "```bash\neyas export run/ --out d/   # a comment may name --anything\n"
                   "eyas train --target T && eyas check d/ --bogus\n```\n"
                   "`eyas.engine.round.Round`, `eyas.engine.nowhere`, `eyas.engine.round.Nothing`; "
                   "src/eyas/engine/round.py, src/eyas/engine/gone.py\n")
    found = command_problems(doc, cli_flags()) + name_problems(doc)
    assert [p.split(": ", 1)[1] for p in found] == [
        "`eyas bench --no-such-flag`: no such flag", "`eyas teleport`: no such command",
        "`eyas check --bogus`: no such flag", "`eyas.engine.nowhere`: no such module or name",
        "`eyas.engine.round.Nothing`: no such module or name", "src/eyas/engine/gone.py: no such path"]
