"""The stress suite's rows (runner/sim/workload.py's `stress-*` presets: bimodal tool times,
observation spikes, a heavy shared prefix, a long tail of step counts, a swarm of 2,048 short
agents, DeepSeek-V3 with spikes), its systems, and the runs bench.stress makes of them
(`paper_runs.Run`s, simulated by `paper_runs.execute`).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.common.paper_runs import Run, rules_of

CAPS = (16, 32, 64, 128)


@dataclass(frozen=True)
class Row:
    key: str
    title: str
    deployment: str
    workload: str


ROWS = [
    Row("slow-tools", "bimodal tools (a fifth 40-80 s), Qwen TP4", "qwen3-32b-tp4",
        "stress-slow-tools"),
    Row("spikes", "observation spikes (15-25K), Qwen TP8", "qwen3-32b-tp8", "stress-spikes"),
    Row("shared-prefix", "8K shared prompt, short turns, Qwen TP2", "qwen3-32b-tp2",
        "stress-shared-prefix"),
    Row("long-tail", "long tail of steps (3-9, 8% 80-95), Qwen TP4", "qwen3-32b-tp4",
        "stress-long-tail"),
    Row("swarm", "2,048 short agents, Qwen TP8", "qwen3-32b-tp8", "stress-swarm"),
    Row("ds-spikes", "DeepSeek-V3 32 agents with spikes, TP16", "deepseek-v3-tp16-paper",
        "stress-deepseek-spikes"),
]  # fmt: skip
# system -> (policy spec, host tier); each runs with its policy's gate rules (rules_of)
SYSTEMS: dict[str, tuple[str, bool]] = {
    "none": ("none", False),
    "hicache": ("none", True),
    "aimd": ("aimd", False),
    "wset": ("wset", False),
    "wset+hicache": ("wset", True),
    "wset2": ("wset2", False),
    "wset2+hicache": ("wset2", True),
    **{f"agent-cap:{n}": (f"agent-cap:{n}", False) for n in CAPS},
}


def plan(only: str | None, systems: list[str] | None) -> list[Run]:
    runs = []
    for row in ROWS:
        if only not in (None, row.key):
            continue
        for name, (spec, host) in SYSTEMS.items():
            if systems and name not in systems:
                continue
            run = Run(
                f"stress-{row.key}-{name.replace(':', '').replace('+', '-')}",
                row.key,
                name,
                spec,  # with its parameters, as --policy takes it
                hicache=host,
                rules=rules_of(spec),
                deployment=row.deployment,
                workload=row.workload,
            )
            runs.append(run)
    return runs
