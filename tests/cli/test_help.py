"""`run.py --help` reads cleanly: parsed from the real command's output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from runner.cli.parser import build_parser
from runner.policies.registry import REGISTRY, describe
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]


def sections(text: str) -> dict[str, list[str]]:
    """Heading -> the option strings listed under it."""
    out: dict[str, list[str]] = {}
    heading = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            heading = line[:-1]
            out[heading] = []
        elif heading is not None and line.startswith("  -"):
            out[heading] += re.findall(r"(?:^|, )(--?[a-z][a-z0-9-]*)", line.strip())
    return out


def test_help_groups_every_option_lists_every_policy_and_shows_no_none():
    text = run_cli("--help").stdout
    listed = sections(text)
    assert listed.pop("options") == ["-h", "--help"]  # nothing else left ungrouped
    shown = {opt for opts in listed.values() for opt in opts}
    parser = build_parser()
    every = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    assert shown == every
    flat = " ".join(text.split())
    policy_help = flat[flat.index("--policy POLICY NAME") : flat.index("--alpha ALPHA AIMD")]
    for name in REGISTRY:  # each one named whole, not broken across lines
        assert re.search(rf"[ ;,]{re.escape(name)}(:|;|,| )", policy_help), name
    assert "run.py policies" in policy_help  # where their parameters are listed
    assert "None" not in text  # no "(default: None)", no "initial=None"
    assert "(default " not in flat  # one wording: "(default: X)"


def test_run_py_policies_lists_every_policy_with_its_parameters():
    out = run_cli("policies").stdout
    for cls in REGISTRY.values():
        assert describe(cls) + "\n" in out, cls.name
    assert "experiment, a slot per agent" in out  # wset, wset2 say what they are


def test_the_command_line_imports_no_experimental_policy():
    """The registry loads an experiment only when it is named: building the parser, even
    formatting --help, leaves them out (the import contract checks the static imports)."""
    code = (
        "import sys; from runner.cli.parser import build_parser; build_parser().format_help(); "
        "print([m for m in sys.modules if 'policies.experimental' in m])"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def test_every_option_has_a_help_text():
    parser = build_parser()
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert missing == []
