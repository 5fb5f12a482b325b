"""Record formats, rollouts, rewards, samples and exports (docs/outputs.md).

In-process batches on the replay engine with the null sandbox cover the formats and the
export quickly; the CLI tests run real batches (bubblewrap; the llama.cpp one is slow)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import jsonschema
import pytest

from runner.batch.batch import Batch, BatchConfig
from runner.chat.template import ChatTemplate, shipped, turn_delta
from runner.chat.toolcall import format_call
from runner.engines.chatml_tokenizer import ChatMLTokenizer
from runner.engines.replay import ReplayEngine, scripts_from_tasks
from runner.policies.baselines import NoGate
from runner.runfolder.export import SKYRL_FIELDS, VERL_FIELDS, VERL_METRICS
from runner.runfolder.export import main as export_main
from runner.runfolder.records import features, schema
from runner.runfolder.store import RunStore
from runner.sim.tools import NullSandbox
from runner.tasks.tasks import expand_samples, validate
from tests.conftest import ROOT, read_jsonl, run_cli, small_tasks, write_jsonl

datasets.disable_progress_bars()

# A tool-capable chat template written for the test: tools rendered into the system turn,
# a real `tool` role, assistant content verbatim.
TOOL_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|im_start|>system\n{{ m['content'] }}"
    "{% if tools %}\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ToolChatMLTokenizer(ChatMLTokenizer):
    """Test double of a tokenizer whose chat template has tools support."""

    def __init__(self) -> None:
        super().__init__()
        self.template = ChatTemplate(TOOL_TEMPLATE)

    @property
    def supports_tools(self) -> bool:
        return True


def call(name: str, **args) -> str:
    return format_call(name, args)


TASKS = [
    {
        "id": "calls",
        "prompt": "list the files",
        "metadata": {"difficulty": "easy", "tags": ["a"]},
        "replay": [
            "Let me look. " + call("bash", command="ls"),
            "no call here",
            call("submit", answer="ok"),
        ],
    },
    {
        "id": "graded",
        "prompt": "graded task",
        "reward": "echo 0.75",
        "replay": [call("bash", command="echo hi")],
    },
]


async def run_batch(
    out: Path, recs: list[dict], *, tok=None, samples: int = 1, rollouts: bool = True
):
    tasks = expand_samples([validate(r) for r in recs], samples)
    engine = ReplayEngine(scripts_from_tasks(tasks), tokenizer=tok)
    store = RunStore(out)
    config = BatchConfig(
        control_period=0.05, git_base=False, rollouts=rollouts, tools=("bash", "submit")
    )
    await Batch(tasks, engine, NullSandbox(), NoGate(), store, config).run()
    store._lock.close()
    return engine.tokenizer


def check_schema(out: Path) -> None:
    for name, file in (("trajectory", "trajectories.jsonl"), ("rollout", "rollouts.jsonl")):
        if not (out / file).exists():
            continue
        v = jsonschema.Draft202012Validator(schema(name))
        for rec in read_jsonl(out / file):
            v.validate(rec)


def check_tokens(traj: dict, roll: dict, tok, logprobs: bool) -> None:
    """The done-when of the token-level rollouts, for one agent."""
    for m in traj["messages"]:  # the replay tokenizer learns its words by encoding them
        tok.encode(m["content"])
    prompt, resp, mask = roll["prompt_ids"], roll["response_ids"], roll["response_mask"]
    assert len(mask) == len(resp) and set(mask) <= {0, 1}
    assert len(prompt) + len(resp) == traj["context_tokens"]
    said = [m["content"] for m in traj["messages"] if m["role"] == "assistant"]
    replies = []
    observations = [m for m in traj["messages"][2:] if m["role"] == "tool"]
    for n, s in enumerate(roll["steps"]):
        out = resp[s["output_start"] : s["output_end"]]
        assert all(mask[s["output_start"] : s["output_end"]])
        assert not any(mask[s["output_end"] : s["observation_end"]])
        replies.append(tok.decode(out))
        obs = resp[s["output_end"] : s["observation_end"]]
        if obs:  # exactly the observation turn the runner appended
            eos = tok.token_text(out[-1]) if out[-1] in tok.eos_ids else ""
            m = observations[n]
            role, content = (
                ("tool", m["content"])
                if tok.supports_tools
                else ("user", f"<tool_response>\n{m['content']}\n</tool_response>")
            )
            delta = turn_delta(lambda ms, g: tok.render(ms, None, g), role, content, eos)
            assert obs == tok.encode(delta)
            assert "".join(tok.token_text(i) for i in obs) == delta
    assert replies == said[len(said) - traj["steps"] :]
    # the mask-1 ids, in order, are the model's outputs
    gen = [i for i, m in zip(resp, mask, strict=True) if m]
    assert gen == [i for s in roll["steps"] for i in resp[s["output_start"] : s["output_end"]]]
    if logprobs:
        assert roll["response_logprobs"] is not None
        lps = roll["response_logprobs"]
        assert len(lps) == len(resp) and all(lp <= 0.0 for lp in lps)
        assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if not m)
    else:
        assert roll["response_logprobs"] is None


def by_id(path: Path) -> dict[str, dict]:
    return {r["task_id"]: r for r in read_jsonl(path)}


# ---- in-process: formats, messages, rewards, tokens ---------------------------------------


async def test_records_follow_the_schema_and_tokens_are_exact(tmp_path):
    out = tmp_path / "run"
    tok = await run_batch(out, TASKS)
    check_schema(out)
    trajs, rolls = by_id(out / "trajectories.jsonl"), by_id(out / "rollouts.jsonl")
    assert set(trajs) == set(rolls) == {"calls", "graded"}
    for tid in trajs:
        check_tokens(trajs[tid], rolls[tid], tok, logprobs=False)
    t = trajs["calls"]
    assert json.loads(t["metadata"]) == {"difficulty": "easy", "tags": ["a"]}
    assert [f["function"]["name"] for f in json.loads(t["tools"])] == ["bash", "submit"]
    roles = [m["role"] for m in t["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    first = t["messages"][2]
    assert first["content"].startswith("Let me look. <tool_call>")  # raw text kept
    assert first["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "bash", "arguments": '{"command": "ls"}'},
        }
    ]
    assert t["messages"][3]["tool_call_id"] == "call_1" and t["messages"][3]["name"] == "bash"
    assert t["messages"][4]["tool_calls"] is None  # "no call here"
    assert (
        t["messages"][5]["tool_call_id"] is None and "no tool call" in t["messages"][5]["content"]
    )
    # the system message is the task's, without the tools text SmolLM2-style templates get
    assert "# Tools" not in t["messages"][0]["content"]
    assert t["reward"] is None and t["eval"]["command"] is None  # no eval, no reward command
    # a reward command the sandbox could not run: an error on the record, not a crash
    g = trajs["graded"]
    assert g["reward"] is None and g["reward_source"] == "command"
    assert "could not run" in g["reward_error"]


async def test_sft_rows_render_back_to_the_engines_token_ids(tmp_path):
    out = tmp_path / "run"
    tok = await run_batch(out, TASKS, tok=ToolChatMLTokenizer())
    check_schema(out)
    sft = tmp_path / "sft.jsonl"
    assert export_main([str(out), "--format", "sft", "--out", str(sft)]) == 0
    rolls = by_id(out / "rollouts.jsonl")
    rows = read_jsonl(sft)
    assert len(rows) == 2
    ids = [r["task_id"] for r in read_jsonl(out / "trajectories.jsonl")]
    for row, tid in zip(rows, ids, strict=True):
        roll = rolls[tid]
        ctx = roll["prompt_ids"] + roll["response_ids"]
        text = ChatTemplate(TOOL_TEMPLATE).render(row["messages"], row["tools"], False)
        ids = tok.encode(text)
        assert ids[: len(ctx)] == ctx
        # the rest only closes the last assistant turn, which the engine never had to see
        assert "".join(tok.token_text(i) for i in ids[len(ctx) :]) == "<|im_end|>\n"


def test_rewards_from_eval_and_from_a_reward_command():
    from runner.runfolder.records import eval_field, eval_reward
    from runner.tasks.rewards import parse_reward

    assert eval_reward(eval_field(None)) is None
    assert eval_reward(eval_field({"command": "true", "solved": True})) == 1.0
    assert eval_reward(eval_field({"command": "false", "solved": False})) == 0.0
    assert parse_reward("log line\n0.5\n\n", 0, False) == (0.5, None)
    for out, code, t_o, why in (
        ("1.0", 1, False, "exited 1"),
        ("", 0, False, "printed nothing"),
        ("score: high", 0, False, "not a float"),
        ("nan", 0, False, "finite"),
        ("1", 0, True, "timed out"),
    ):
        value, err = parse_reward(out, code, t_o)
        assert value is None and why in err


def test_pass_at_k_is_the_unbiased_estimator():
    from runner.runfolder.summary import pass_at_k

    def rec(task, solved):
        return {"task_id": task, "task": task, "eval": {"command": "x", "solved": solved}}

    recs = [rec("a", s) for s in (True, False, False, False)] + [rec("b", False)] * 4
    got = pass_at_k(recs)
    # a: n=4, c=1: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1; b: 0
    assert got == {"pass@1": 0.125, "pass@2": 0.25, "pass@4": 0.5}
    assert pass_at_k([{"task_id": "a", "eval": {"command": None}}]) is None


async def test_samples_are_distinct_agents_with_their_own_seeds(tmp_path):
    out = tmp_path / "run"
    await run_batch(out, TASKS, samples=3)
    trajs = read_jsonl(out / "trajectories.jsonl")
    assert sorted(t["task_id"] for t in trajs) == sorted(
        f"{t}#{k}" for t in ("calls", "graded") for k in range(3)
    )
    for task in ("calls", "graded"):
        group = [t for t in trajs if t["task"] == task]
        assert sorted(t["sample"] for t in group) == [0, 1, 2]
        assert len({t["seed"] for t in group}) == 3
    assert len(read_jsonl(out / "rollouts.jsonl")) == 6


# ---- durability of rollouts --------------------------------------------------------------


async def test_a_rollout_without_its_trajectory_is_cut_on_open(tmp_path):
    out = tmp_path / "run"
    await run_batch(out, TASKS[:1])
    rolls = (out / "rollouts.jsonl").read_text()
    orphan = json.loads(rolls.splitlines()[0])
    with (out / "rollouts.jsonl").open("a") as f:  # what a kill between the writes leaves
        for k in range(3):  # a driver's batch of rollouts whose trajectories never came
            f.write(json.dumps({**orphan, "task_id": f"killed-before-{k}"}) + "\n")
        f.write('{"format": 2, "task_id": "tor')  # and a torn line after them
    store = RunStore(out)
    assert store.repaired_bytes > 0
    assert (out / "rollouts.jsonl").read_text() == rolls
    torn = (out / "rollouts.jsonl.torn").read_text()
    assert all(f"killed-before-{k}" in torn for k in range(3))


# ---- loading runs together ----------------------------------------------------------------


async def _runs(tmp_path: Path) -> tuple[Path, Path]:
    """Two runs of different settings: one with eval (failing: the null sandbox runs
    nothing) and a tool-capable template; one without eval, 2 samples, no rollouts."""
    a, b = tmp_path / "a", tmp_path / "b"
    with_eval = [{**t, "eval": "true"} for t in TASKS]
    await run_batch(a, with_eval, tok=ToolChatMLTokenizer())
    no_eval = {**{k: v for k, v in TASKS[0].items() if k != "metadata"}, "max_steps": 1}
    await run_batch(b, [no_eval], samples=2, rollouts=False)
    return a, b


async def test_runs_of_different_settings_load_together(tmp_path):
    a, b = await _runs(tmp_path)
    # a 20 MB+ trajectories file: many copies of a's records
    big = tmp_path / "big"
    big.mkdir()
    recs = read_jsonl(a / "trajectories.jsonl")
    line_len = len(json.dumps(recs[0]))
    with (big / "trajectories.jsonl").open("w") as f:
        for i in range(21_000_000 // line_len + 1):
            r = dict(recs[i % len(recs)], task_id=f"copy-{i}")
            f.write(json.dumps(r) + "\n")
    assert (big / "trajectories.jsonl").stat().st_size > 20_000_000
    files = [str(p / "trajectories.jsonl") for p in (b, a, big)]
    ds = datasets.load_dataset(
        "json",
        data_files=files,
        features=features("trajectory"),
        split="train",
        cache_dir=str(tmp_path / "cache"),
    )
    assert len(ds) == 2 + 2 + 21_000_000 // line_len + 1
    assert ds[0]["eval"]["command"] is None and ds[2]["eval"]["command"] == "true"
    rolls = datasets.load_dataset(
        "json",
        data_files=str(a / "rollouts.jsonl"),
        features=features("rollout"),
        split="train",
        cache_dir=str(tmp_path / "cache"),
    )
    assert len(rolls) == 2


# ---- export -------------------------------------------------------------------------------


def export(*args) -> int:
    return export_main([str(a) for a in args])


@pytest.mark.parametrize("fmt", ["sft", "sft-structured", "verl", "skyrl", "messages"])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ""])
async def test_every_format_and_kind_loads_with_datasets(tmp_path, fmt, suffix):
    a, _ = await _runs(tmp_path)
    out = tmp_path / f"export{suffix}"
    extra = ["--null-reward", "0"] if fmt in ("verl", "skyrl") else []
    assert export(a, "--format", fmt, *extra, "--out", out) == 0
    if suffix == "":
        ds = datasets.load_from_disk(str(out))
    else:
        kind = "json" if suffix == ".jsonl" else "parquet"
        ds = datasets.load_dataset(
            kind, data_files=str(out), split="train", cache_dir=str(tmp_path / "c")
        )
    assert len(ds) == 2
    # the row of the "calls" task (three steps), whichever agent finished first
    task = {
        "verl": lambda r: r["extra_fields"]["task"],
        "skyrl": lambda r: r["trajectory_ids"]["instance_id"],
        "messages": lambda r: r["task"],
    }.get(fmt, lambda r: "calls" if r["messages"][1]["content"] == "list the files" else "")
    row = next(r for r in ds if task(r) == "calls")
    if fmt == "verl":
        assert set(row) == set(VERL_FIELDS) and row["num_turns"] == 1 + 2 * 3 - 1
        assert row["metrics"]["num_preempted"] == -1 and row["extra_fields"]["task"] == "calls"
        other = next(r for r in ds if r["extra_fields"]["task"] == "graded")
        assert other["reward_score"] == 0.0  # the null reward, mapped by --null-reward 0
    elif fmt == "skyrl":
        assert set(row) == set(SKYRL_FIELDS) and row["stop_reasons"] == "stop"
        assert row["trajectory_ids"] == {"instance_id": "calls", "repetition_id": 0}
        assert row["is_last_step"] is True and isinstance(row["rewards"], float)
    elif fmt in ("sft", "sft-structured"):
        assert set(row) == {"messages", "tools"}
        # tools stay a list of the schemas as they are: no keys merged in from other tools
        assert [t["function"]["name"] for t in row["tools"]] == ["bash", "submit"]
        assert row["tools"] == json.loads(read_jsonl(a / "trajectories.jsonl")[0]["tools"])
        said = [m for m in row["messages"] if m["role"] == "assistant"]
        if fmt == "sft":
            assert all(m["tool_calls"] is None for m in said)
        else:
            assert said[0]["content"] == "Let me look."
            assert said[0]["tool_calls"][0]["function"]["arguments"] == {"command": "ls"}
            assert said[2]["tool_calls"][0]["function"]["arguments"] == {"answer": "ok"}
    else:
        assert row["messages"][2]["tool_calls"][0]["function"]["name"] in ("bash", "submit")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".export-")] == []


async def test_structured_sft_writes_each_call_once_and_raw_sft_renders_what_the_model_saw(
    tmp_path,
):
    """sft-structured: the call's text out of the content, in tool_calls with object
    arguments; rendered by a tools template each call appears once. sft (raw) rendered by
    the shipped chatml-tools template is the text the engine saw, for a template without
    tools support (the replay's ChatML, like SmolLM2's), and the template marks exactly the
    assistant's turns."""
    out = tmp_path / "run"
    tok = await run_batch(out, TASKS)  # ChatML without tools: the runner's SmolLM2 path
    raw, structured = tmp_path / "raw.jsonl", tmp_path / "structured.jsonl"
    assert export(out, "--format", "sft", "--out", raw, "--chat-template", "chatml-tools") == 0
    assert export(out, "--format", "sft-structured", "--out", structured) == 0
    shipped_text = shipped("chatml-tools").read_text()
    assert (tmp_path / "raw.chat_template.jinja").read_text() == shipped_text
    tmpl = ChatTemplate(shipped_text)
    assert tmpl.marks_generation and tmpl.supports_tools
    rolls = by_id(out / "rollouts.jsonl")
    trajs = read_jsonl(out / "trajectories.jsonl")
    for row, srow, traj in zip(read_jsonl(raw), read_jsonl(structured), trajs, strict=True):
        roll = rolls[traj["task_id"]]
        seen = "".join(tok.token_text(i) for i in roll["prompt_ids"] + roll["response_ids"])
        text = tmpl.render(row["messages"], row["tools"], add_generation_prompt=False)
        assert text == seen + "<|im_end|>\n"  # the engine never had to see the last close
        for m, sm in zip(row["messages"], srow["messages"], strict=True):
            if m["role"] != "assistant" or not sm["tool_calls"]:
                assert sm == m
                continue
            call = sm["tool_calls"][0]["function"]
            assert isinstance(call["arguments"], dict) and "<tool_call>" not in sm["content"]
            assert call["name"] in m["content"] and sm["content"] in m["content"]
        # each call rendered once: in the assistant's text, from tool_calls alone
        spans = assistant_spans(tmpl, srow)
        calls = [m["tool_calls"] for m in srow["messages"] if m["role"] == "assistant"]
        assert [x.count("<tool_call>") for x in spans] == [len(c or []) for c in calls]
        # the marks enclose exactly the assistant turns' text
        said = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert assistant_spans(tmpl, row) == [c + "<|im_end|>" for c in said]


def assistant_spans(tmpl: ChatTemplate, row: dict) -> list[str]:
    """What the template's {% generation %} marks enclose, rendering `row`."""
    marked = tmpl.source.replace("{%- generation %}", "{{- '[[' }}").replace(
        "{%- endgeneration %}", "{{- ']]' }}"
    )
    text = ChatTemplate(marked).render(row["messages"], row["tools"], False)
    return [x.split("]]")[0] for x in text.split("[[")[1:]]


async def test_a_chat_template_without_generation_marks_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    await run_batch(out, TASKS)
    plain = tmp_path / "plain.jinja"
    plain.write_text(TOOL_TEMPLATE)
    for name, msg in ((str(plain), "no {% generation %} marks"),
                      ("nope", "no shipped chat template 'nope'")):  # fmt: skip
        dest = tmp_path / "x.jsonl"
        assert export(out, "--format", "sft", "--out", dest, "--chat-template", name) == 1
        assert msg in capsys.readouterr().err and not dest.exists()
    assert export(out, "--format", "verl", "--chat-template", "chatml-tools", "--out", dest) == 1
    assert "--chat-template is for --format sft" in capsys.readouterr().err


async def test_rl_rows_per_trainer_per_step_and_null_rewards(tmp_path, capsys):
    """verl rows carry AgentLoopOutput's fields and SkyRL rows GeneratorOutput's, with the
    types each declares (VERL_FIELDS, SKYRL_FIELDS: the consumer check in bench/ holds them
    against the released classes); --per-step cuts each rollout at its steps; a null reward
    is an error unless mapped."""
    out = tmp_path / "run"  # calls: eval fails, reward 0.0; graded: its command fails, null
    await run_batch(out, [{**t, "eval": "true"} for t in TASKS])
    rolls = by_id(out / "rollouts.jsonl")
    dest = tmp_path / "v.jsonl"
    assert export(out, "--format", "verl", "--out", dest) == 1
    err = capsys.readouterr().err
    assert "agent 'graded' has no reward" in err and "--null-reward" in err and not dest.exists()
    assert export(out, "--format", "skyrl", "--null-reward", "keep", "--out", dest) == 1
    assert "SkyRL's rewards are floats" in capsys.readouterr().err
    assert export(out, "--format", "verl", "--per-step", "--out", tmp_path / "x.jsonl",
                  "--null-reward", "maybe") == 1  # fmt: skip
    assert "--null-reward maybe" in capsys.readouterr().err

    def rows(fmt, *args):
        path = tmp_path / f"{fmt}{len(args)}{'-'.join(args)}.jsonl"
        assert export(out, "--format", fmt, *args, "--out", path) == 0
        return read_jsonl(path)

    verl = rows("verl", "--null-reward", "drop")
    assert [r["extra_fields"]["task_id"] for r in verl] == ["calls"]  # graded dropped
    kept = rows("verl", "--null-reward", "keep")
    got = {r["extra_fields"]["task_id"]: r["reward_score"] for r in kept}
    assert got == {"calls": 0.0, "graded": None}
    for r in kept:
        assert_types(r, VERL_FIELDS)
        roll = rolls[r["extra_fields"]["task_id"]]
        assert r["prompt_ids"] == roll["prompt_ids"] and r["response_ids"] == roll["response_ids"]
        assert r["response_mask"] == roll["response_mask"]
        assert set(r["metrics"]) == set(VERL_METRICS)
    sky = rows("skyrl", "--null-reward", "0.5")
    for r in sky:
        assert_types(r, SKYRL_FIELDS)
        roll = rolls[r["env_metrics"]["task_id"]]
        assert r["loss_masks"] == roll["response_mask"]
        assert r["rewards"] == (0.5 if roll["reward"] is None else roll["reward"])
    steps = rows("skyrl", "--per-step", "--null-reward", "1")
    calls = [r for r in steps if r["env_metrics"]["task_id"] == "calls"]
    roll = rolls["calls"]
    assert len(calls) == len(roll["steps"]) == 3
    assert [r["is_last_step"] for r in calls] == [False, False, True]
    for r, st in zip(calls, roll["steps"], strict=True):
        assert_types(r, SKYRL_FIELDS)
        a, b, c = st["output_start"], st["output_end"], st["observation_end"]
        full = roll["prompt_ids"] + roll["response_ids"]
        assert r["prompt_token_ids"] == full[: len(roll["prompt_ids"]) + a]
        assert r["response_ids"] == roll["response_ids"][a:c]
        assert r["loss_masks"] == [1] * (b - a) + [0] * (c - b)
        assert len(r["rewards"]) == c - a
    assert all(x == 0.0 for r in calls for x in r["rewards"])  # calls' reward is 0.0
    *before, last = [r for r in steps if r["env_metrics"]["task_id"] == "graded"]  # null -> 1
    assert last["is_last_step"] and last["rewards"][-1] == 1.0 == sum(last["rewards"])
    assert all(x == 0.0 for r in before for x in r["rewards"])
    vsteps = rows("verl", "--per-step", "--null-reward", "1")
    assert [r["num_turns"] for r in vsteps if r["extra_fields"]["task_id"] == "calls"] == [
        3, 5, 6]  # fmt: skip
    # a batch of skyrl rows, column by column, is SkyRL's GeneratorOutput
    batch = {k: [r[k] for r in steps] for k in SKYRL_FIELDS}
    assert len({len(v) for v in batch.values()}) == 1


def assert_types(row: dict, spec: dict[str, str]) -> None:
    """Each field of `spec` present with a value of its declared type."""
    one = {"int": int, "float": float, "str": str, "bool": bool, "dict": dict, "None": type(None)}

    def ok(v, t: str) -> bool:
        if t.startswith("list["):
            return isinstance(v, list) and all(ok(x, t[5:-1]) for x in v)
        if t == "float" and isinstance(v, int) and not isinstance(v, bool):
            return False
        return isinstance(v, one[t]) and not (t == "int" and isinstance(v, bool))

    assert set(row) == set(spec), set(row) ^ set(spec)
    for k, t in spec.items():
        assert any(ok(row[k], alt.strip()) for alt in t.split("|")), (k, t, row[k])


async def test_filters_select_and_an_empty_selection_is_an_error(tmp_path, capsys):
    a, b = await _runs(tmp_path)
    out = tmp_path / "all.jsonl"
    assert export(a, b, "--format", "messages", "--out", out) == 0
    assert len(read_jsonl(out)) == 4
    sub = tmp_path / "sub.jsonl"
    assert export(a, b, "--format", "messages", "--only", "submitted", "--out", sub) == 0
    assert [r["status"] for r in read_jsonl(sub)] == ["submitted"] * 2
    # the null sandbox fails every eval: nothing is solved, nothing has reward >= 0.5
    for args in (["--only", "solved"], ["--min-reward", "0.5"]):
        none = tmp_path / f"none{len(args[0])}.jsonl"
        assert export(a, "--format", "sft", *args, "--out", none) == 1
        assert "matches no trajectory" in capsys.readouterr().err and not none.exists()
    low = tmp_path / "low.jsonl"  # the failed eval's 0.0 passes, the null reward does not
    assert export(a, "--format", "verl", "--min-reward", "0", "--out", low) == 0
    assert [r["extra_fields"]["task_id"] for r in read_jsonl(low)] == ["calls"]
    # solved after a re-score: the filter reads the new eval
    store = RunStore(a)
    store.rewrite_trajectories(
        lambda r: (
            {**r, "eval": {**r["eval"], "solved": True}, "reward": 1.0}
            if r["task_id"] == "calls"
            else r
        )
    )
    store._lock.close()
    solved = tmp_path / "solved.jsonl"
    assert export(a, "--format", "sft", "--only", "solved", "--out", solved) == 0
    assert len(read_jsonl(solved)) == 1


async def test_bad_input_is_a_clear_error_and_nothing_is_written(tmp_path, capsys):
    a, b = await _runs(tmp_path)
    cases = [
        ([tmp_path / "missing", "--format", "sft"], "no such run folder"),
        ([a, b, "--format", "skyrl"], "rollouts.jsonl does not exist"),
        ([a, "--format", "rl"], "--format verl"),
        ([a, "--format", "dpo"], "--format dpo: unknown"),
        ([a, "--format", "sft", "--per-step"], "--per-step is for --format verl"),
    ]
    for args, msg in cases:
        out = tmp_path / "x.jsonl"
        assert export(*args, "--out", out) == 1
        assert msg in capsys.readouterr().err and not out.exists()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "trajectories.jsonl").write_text('{"task_id": "a"\n' + "{}\n")
    out = tmp_path / "c.parquet"
    assert export(corrupt, "--format", "messages", "--out", out) == 1
    assert "trajectories.jsonl:1: not a JSON record" in capsys.readouterr().err
    assert not out.exists()
    exists = tmp_path / "exists.jsonl"
    exists.write_text("keep me")
    assert export(a, "--format", "sft", "--out", exists) == 1
    assert "already exists" in capsys.readouterr().err and exists.read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".export-")] == []


async def test_push_to_hub_offline_is_a_clear_error(tmp_path, capsys, monkeypatch):
    a, _ = await _runs(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert export(a, "--format", "sft", "--push-to-hub", "someone/data") == 1
    assert "--push-to-hub someone/data" in capsys.readouterr().err


async def test_export_is_a_subcommand_of_run_py(tmp_path):
    a, _ = await _runs(tmp_path)
    out = tmp_path / "sft.jsonl"
    p = run_cli("export", str(a), "--format", "sft", "--out", str(out))
    assert "2 sft rows" in p.stderr and len(read_jsonl(out)) == 2


# ---- real batches (CLI) ------------------------------------------------------------------


REPLAY = ["--engine", "replay", "--policy", "none", "--control-period", "0.2"]


def test_a_real_replay_run_follows_the_schema_with_eval_and_rewards(tmp_path, needs_bwrap):
    tasks = tmp_path / "t.jsonl"
    recs = [
        {
            **TASKS[0],
            "eval": "test -f x",
            "replay": [call("bash", command="touch x"), "no call", call("submit", answer="ok")],
        },
        {**TASKS[1], "eval": "false"},
        {
            "id": "bad-reward",
            "prompt": "p",
            "reward": "echo high",
            "replay": [call("submit", answer="x")],
        },
    ]
    write_jsonl(tasks, recs)
    out = tmp_path / "out"
    run_cli("--tasks", str(tasks), "--out", str(out), *REPLAY)
    check_schema(out)
    trajs, rolls = by_id(out / "trajectories.jsonl"), by_id(out / "rollouts.jsonl")
    tok = ChatMLTokenizer()
    for tid in trajs:
        check_tokens(trajs[tid], rolls[tid], tok, logprobs=False)
    assert trajs["calls"]["reward"] == 1.0 and trajs["calls"]["reward_source"] == "eval"
    assert trajs["graded"]["reward"] == 0.75 and trajs["graded"]["reward_source"] == "command"
    bad = trajs["bad-reward"]
    assert bad["reward"] is None and "not a float: 'high'" in bad["reward_error"]
    assert rolls["calls"]["reward"] == 1.0 and rolls["calls"]["solved"] is True
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pass_at_k"] == {"pass@1": 0.5}


def test_eval_only_runs_the_reward_command_again(tmp_path, needs_bwrap):
    # the reward reads a file of the workspace: edited in the kept workspace, it changes
    tasks = tmp_path / "t.jsonl"
    recs = [
        {
            "id": "graded",
            "prompt": "p",
            "eval": "test -f score",
            "reward": "cat score",
            "replay": [call("bash", command="echo 0.25 > score"), call("submit", answer="x")],
        },
        {**TASKS[0], "eval": "test -f x"},  # eval-derived reward: follows the eval
    ]
    write_jsonl(tasks, recs)
    out = tmp_path / "out"
    run_cli("--tasks", str(tasks), "--out", str(out), "--keep-workspaces", *REPLAY)
    first = by_id(out / "trajectories.jsonl")
    assert first["graded"]["reward"] == 0.25 and first["calls"]["reward"] == 0.0
    (out / "workspaces" / "graded" / "score").write_text("log\n0.875\n")
    (out / "workspaces" / "calls" / "x").write_text("")
    run_cli("--tasks", str(tasks), "--out", str(out), "--eval-only")
    trajs, rolls = by_id(out / "trajectories.jsonl"), by_id(out / "rollouts.jsonl")
    g = trajs["graded"]
    assert (g["reward"], g["reward_source"], g["reward_error"]) == (0.875, "command", None)
    assert g["reward_output"] == "log\n0.875\n" and g["rescored_at"] is not None
    assert trajs["calls"]["reward"] == 1.0 and trajs["calls"]["reward_source"] == "eval"
    assert rolls["graded"]["reward"] == 0.875 and rolls["calls"]["reward"] == 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_only"]["rewards_rerun"] == 1 and summary["eval_only"]["rescored"] == 2
    # a reward command that now fails: an error on that record, the others unchanged
    (out / "workspaces" / "graded" / "score").write_text("oops\n")
    run_cli("--tasks", str(tasks), "--out", str(out), "--eval-only")
    g = by_id(out / "trajectories.jsonl")["graded"]
    assert g["reward"] is None and "not a float: 'oops'" in g["reward_error"]
    assert by_id(out / "rollouts.jsonl")["graded"]["reward"] is None


def test_samples_after_sigkill_each_sample_completes_once(tmp_path, needs_bwrap):
    tasks = tmp_path / "t.jsonl"
    slow = [call("bash", command="sleep 0.4")] * 3
    tasks.write_text(
        "".join(json.dumps({"id": f"s{i}", "prompt": "p", "replay": slow}) + "\n" for i in range(2))
    )
    out = tmp_path / "out"
    args = [sys.executable, str(ROOT / "run.py"), "--tasks", str(tasks), "--out", str(out)]
    args += ["--samples", "3", "--engine", "replay", "--policy", "agent-cap:2"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    traj = out / "trajectories.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if traj.exists() and traj.read_text().count("\n") >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the batch ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = traj.read_text().count("\n")
    assert 2 <= first < 6
    run_cli(*args[2:])  # the same command again resumes it
    want = sorted(f"s{i}#{k}" for i in range(2) for k in range(3))
    assert sorted(r["task_id"] for r in read_jsonl(traj)) == want
    assert sorted(r["task_id"] for r in read_jsonl(out / "rollouts.jsonl")) == want
    check_schema(out)


@pytest.mark.slow
async def test_a_real_llama_cpp_run_has_exact_rollouts_with_logprobs(tmp_path, needs_bwrap):
    from runner.engines.llama_cpp import LlamaCppEngine

    tasks = small_tasks(tmp_path / "t.jsonl", 2, max_steps=2)
    out = tmp_path / "out"
    run_cli(
        "--tasks",
        str(tasks),
        "--out",
        str(out),
        "--max-new-tokens",
        "32",
        "--n-ctx",
        "4096",
        "--control-period",
        "0.5",
    )
    check_schema(out)
    trajs, rolls = by_id(out / "trajectories.jsonl"), by_id(out / "rollouts.jsonl")
    assert set(trajs) == set(rolls) and len(trajs) == 2
    eng = LlamaCppEngine(n_ctx=512, n_threads=2, pool_tokens=1024, max_seqs=2)
    try:
        for tid in trajs:
            check_tokens(trajs[tid], rolls[tid], eng.tokenizer, logprobs=True)
            lps = rolls[tid]["response_logprobs"]
            n_generated = sum(rolls[tid]["response_mask"])
            assert n_generated == trajs[tid]["completion_tokens"]
            assert len(lps) == len(rolls[tid]["response_mask"])
        check_exports_with_real_tokens(tmp_path, out, eng.tokenizer)
    finally:
        await eng.aclose()


def check_exports_with_real_tokens(tmp_path: Path, run: Path, tok) -> None:
    """Every exported RL row of a real run: its ids are in the model's vocabulary, decode to
    the conversation as the model saw it (the raw sft row rendered by the shipped template,
    from the record's messages), and have a logprob exactly where the mask is 1; per-step
    rows tile the rollout."""
    text_of = {}
    sft = tmp_path / "sft.jsonl"
    assert export(run, "--format", "sft", "--out", sft, "--chat-template", "chatml-tools") == 0
    tmpl = ChatTemplate((tmp_path / "sft.chat_template.jinja").read_text())
    for row, traj in zip(read_jsonl(sft), read_jsonl(run / "trajectories.jsonl"), strict=True):
        # an agent stopped after an observation (max_steps) had the next generation prompt
        # appended too
        prompt_next = row["messages"][-1]["role"] == "tool"
        text_of[traj["task_id"]] = tmpl.render(row["messages"], row["tools"], prompt_next)
    rolls = by_id(run / "rollouts.jsonl")
    opts = ["--null-reward", "0"]  # these tasks have no eval
    for fmt, ids, resp, mask, lps, who in (
        ("verl", "prompt_ids", "response_ids", "response_mask", "response_logprobs",
         lambda r: r["extra_fields"]["task_id"]),
        ("skyrl", "prompt_token_ids", "response_ids", "loss_masks", "rollout_logprobs",
         lambda r: r["env_metrics"]["task_id"]),
    ):  # fmt: skip
        for per_step in ([], ["--per-step"]):
            path = tmp_path / f"{fmt}{len(per_step)}.jsonl"
            assert export(run, "--format", fmt, *opts, *per_step, "--out", path) == 0
            rows = read_jsonl(path)
            tiles: dict[str, list[int]] = {}
            for r in rows:
                tid = who(r)
                seq = r[ids] + r[resp]
                assert all(0 <= i < tok.n_vocab for i in seq)
                assert len(r[mask]) == len(r[resp]) == len(r[lps])
                for m, lp in zip(r[mask], r[lps], strict=True):
                    assert (math.isfinite(lp) and lp <= 0.0) if m else (lp == 0.0)
                assert sum(lp for m, lp in zip(r[mask], r[lps], strict=True) if m) < 0.0
                text = "".join(tok.token_text(i) for i in seq)
                assert text_of[tid].startswith(text)
                if not per_step:
                    assert text_of[tid][len(text) :] in ("", "<|im_end|>\n")
                else:
                    have = tiles.setdefault(tid, list(r[ids]))
                    assert r[ids] == have  # the step's prompt: everything before it
                    have += r[resp]
            if per_step:
                for tid, roll in rolls.items():
                    assert tiles[tid] == roll["prompt_ids"] + roll["response_ids"]
            assert {who(r) for r in rows} == set(rolls)


async def test_the_report_reads_format_2_records(tmp_path):
    from runner.report.load import reward, solved

    out = tmp_path / "run"
    await run_batch(out, TASKS)
    t = by_id(out / "trajectories.jsonl")["calls"]
    assert t["eval"]["command"] is None and reward(t) is None and solved(t) is None
