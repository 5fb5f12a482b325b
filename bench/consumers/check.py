"""The trainers' side of bench/export_consumers.py: run by the consumer environment's python
(bench/consumers/requirements.txt), never by the runner's. Reads the exports of one real run
and checks that each is taken unchanged:

- sft and sft-structured: loaded with `datasets.load_dataset("json")`, two steps of TRL's
  SFTTrainer on the runner's default model (SmolLM2-135M, read from its GGUF by
  transformers), `assistant_only_loss=True` with the exported chat template; the raw rows,
  rendered by transformers' own chat-template code, give the text the engine saw.
- verl and verl --per-step: `AgentLoopOutput(**row)` for every row, strictly validated, and
  its `as_dict()` (the tensors verl's worker stacks).
- skyrl and skyrl --per-step: the rows, column by column, as SkyRL's `GeneratorOutput`, each
  key validated strictly against its declared type.

verl and SkyRL are not installed (their dependencies are GPU stacks); their released wheels
are read instead: the classes are taken from the wheel's source file by name and defined
here with pydantic and torch, exactly as released.

    python check.py --exports DIR --run RUN --model GGUF --wheels DIR --out RESULT.json
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import time
import typing
import zipfile
from pathlib import Path
from typing import Any


def released_classes(wheel: Path, member: str, names: tuple[str, ...], ns: dict) -> dict:
    """The classes `names` of `member` in `wheel`, defined in namespace `ns`."""
    src = zipfile.ZipFile(wheel).read(member).decode()
    tree = ast.parse(src)
    body = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in names]
    found = {n.name for n in body}
    if found != set(names):
        raise SystemExit(f"{wheel.name}:{member}: missing {sorted(set(names) - found)}")
    # dont_inherit: not this file's `from __future__ import annotations` (pydantic resolves
    # the fields at class creation, in `ns`)
    code = compile(ast.Module(body=body, type_ignores=[]), f"{wheel.name}/{member}", "exec",
                   dont_inherit=True)  # fmt: skip
    exec(code, ns)
    return {n: ns[n] for n in names}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def check_verl(rows: list[dict], wheel: Path) -> dict:
    import torch
    from pydantic import BaseModel, ConfigDict

    ns = {"BaseModel": BaseModel, "ConfigDict": ConfigDict, "Any": Any,
          "Optional": typing.Optional, "torch": torch}  # fmt: skip
    cls = released_classes(
        wheel, "verl/experimental/agent_loop/agent_loop.py",
        ("AgentLoopMetrics", "AgentLoopOutput"), ns,
    )["AgentLoopOutput"]  # fmt: skip
    built = 0
    for row in rows:
        out = cls.model_validate(row, strict=True)
        d = out.as_dict()
        assert d["responses"].shape == d["response_mask"].shape, d.keys()
        built += 1
    required = sorted(k for k, f in cls.model_fields.items() if f.is_required())
    return {"rows": len(rows), "built": built, "required_fields": required,
            "row_fields": sorted(rows[0]), "unknown_fields": sorted(
                set(rows[0]) - set(cls.model_fields))}  # fmt: skip


def check_skyrl(rows: list[dict], wheel: Path) -> dict:
    import torch
    from pydantic import TypeAdapter

    ns: dict[str, Any] = {k: getattr(typing, k) for k in typing.__all__}
    ns |= {"dataclass": dataclasses.dataclass, "torch": torch, "ConversationType": list}
    got = released_classes(
        wheel, "skyrl/train/generators/base.py", ("TrajectoryID", "GeneratorOutput"), ns
    )
    tid, out = got["TrajectoryID"], got["GeneratorOutput"]
    hints = typing.get_type_hints(out, ns)
    batch: dict[str, Any] = {k: [r[k] for r in rows] for k in rows[0]}
    batch["trajectory_ids"] = [tid(**d) for d in batch["trajectory_ids"]]
    unknown = sorted(set(batch) - set(hints))
    checked = []
    for key, ann in hints.items():
        if key in ("pixel_values", "image_grid_thw"):
            continue  # vision models only; SkyRL's own generator leaves them out otherwise
        # keys the rows do not carry (batch-level or other engines' data) are None, as
        # SkyRL's generator sets them
        TypeAdapter(ann).validate_python(batch.get(key), strict=True)
        checked.append(key)
    return {"rows": len(rows), "keys_checked": checked, "unknown_fields": unknown,
            "rewards_type": type(rows[0]["rewards"]).__name__}  # fmt: skip


def check_trl(path: Path, template: Path, model: Path, run: Path, work: Path) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
    gguf = AutoModelForCausalLM.from_pretrained(
        str(model.parent), gguf_file=model.name, dtype=torch.float32
    )
    # transformers dequantizes the GGUF to float32 but still marks the model quantized,
    # which its Trainer refuses: the same weights in a plain model
    config = gguf.config
    config.__dict__.pop("quantization_config", None)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lm.load_state_dict(gguf.state_dict())
    ds = datasets.load_dataset("json", data_files=str(path), split="train",
                               cache_dir=str(work / "cache"))  # fmt: skip
    chat = template.read_text()
    res: dict[str, Any] = {"rows": len(ds)}
    # transformers' own rendering of every row (the tokenizer's apply_chat_template)
    lengths, calls_once = [], True
    for row in ds:
        ids = tok.apply_chat_template(row["messages"], tools=row["tools"], chat_template=chat,
                                      tokenize=True, return_dict=True)["input_ids"]  # fmt: skip
        lengths.append(len(ids))
        text = tok.apply_chat_template(row["messages"], tools=row["tools"],
                                       chat_template=chat, tokenize=False)  # fmt: skip
        # every call written once: as many calls in the text as the row has (the raw rows
        # hold theirs in the content), not counting the example in the tools description
        head = tok.apply_chat_template(row["messages"][:1], tools=row["tools"],
                                       chat_template=chat, tokenize=False)  # fmt: skip
        said = [m for m in row["messages"] if m["role"] == "assistant"]
        structured = sum(len(m.get("tool_calls") or []) for m in said)
        raw = sum(m["content"].count("<tool_call>") for m in said) if not structured else 0
        calls_once &= text.count("<tool_call>{") - head.count("<tool_call>{") == structured + raw
    res["tokens_per_row"] = lengths
    res["each_call_rendered_once"] = calls_once
    if "structured" not in path.name:  # raw rows: the text the engine saw, token ids decoded
        rolls = {r["task_id"]: r for r in read_jsonl(run / "rollouts.jsonl")}
        trajs = read_jsonl(run / "trajectories.jsonl")
        same = 0
        for row, traj in zip(ds, trajs, strict=True):
            roll = rolls[traj["task_id"]]
            seen = tok.decode(roll["prompt_ids"] + roll["response_ids"])
            # an agent stopped after an observation had the next generation prompt appended
            text = tok.apply_chat_template(
                row["messages"], tools=row["tools"], chat_template=chat, tokenize=False,
                add_generation_prompt=row["messages"][-1]["role"] == "tool")  # fmt: skip
            same += text.startswith(seen) and text[len(seen) :] in ("", "<|im_end|>\n")
        res["raw_rows_render_the_text_the_engine_saw"] = f"{same} of {len(trajs)}"
    cfg = SFTConfig(
        output_dir=str(work / "out"), max_steps=2, per_device_train_batch_size=1,
        learning_rate=1e-5, logging_steps=1, report_to=[], save_strategy="no",
        chat_template_path=str(template), assistant_only_loss=True, max_length=4096,
        use_cpu=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer = SFTTrainer(model=lm, args=cfg, train_dataset=ds, processing_class=tok)
    # the tokens the loss reads: TRL 1.16 turns the assistant mask into labels (-100 elsewhere)
    cols = trainer.train_dataset.column_names
    res["dataset_columns"] = cols
    if "labels" in cols:
        trained = [sum(x != -100 for x in row) for row in trainer.train_dataset["labels"]]
    else:
        trained = [int(sum(m)) for m in trainer.train_dataset["assistant_masks"]]
    res["assistant_tokens_per_row"] = trained
    assert all(n > 0 for n in trained), trained
    trainer.train()
    res["train_seconds"] = round(time.perf_counter() - t0, 1)
    res["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    res["steps"] = trainer.state.global_step
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--exports", type=Path, required=True)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--wheels", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    import importlib.metadata as md

    res: dict[str, Any] = {"versions": {k: md.version(k) for k in (
        "trl", "transformers", "datasets", "torch", "pydantic")}}  # fmt: skip
    verl = next(a.wheels.glob("verl-*.whl"))
    skyrl = next(a.wheels.glob("skyrl-*.whl"))
    res["versions"] |= {"verl": verl.name.split("-")[1], "skyrl": skyrl.name.split("-")[1]}
    checks: dict[str, Any] = {}
    for name in ("verl", "verl-per-step"):
        checks[name] = check_verl(read_jsonl(a.exports / f"{name}.jsonl"), verl)
    for name in ("skyrl", "skyrl-per-step"):
        checks[name] = check_skyrl(read_jsonl(a.exports / f"{name}.jsonl"), skyrl)
    for name in ("sft", "sft-structured"):
        checks[name] = check_trl(a.exports / f"{name}.jsonl",
                                 a.exports / f"{name}.chat_template.jinja", a.model, a.run,
                                 a.exports / f"work-{name}")  # fmt: skip
    res["checks"] = checks
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
