"""`run.py report`: the estimators, the table over real and written run folders, comparisons,
bad input."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from runner.report.stats import newcombe, paired_difference, pass_at_k, pass_at_k_mean, wilson

ROOT = Path(__file__).resolve().parents[2]


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "report", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def write_run(root: Path, records: list[dict], source: str = "tasks/x.jsonl") -> Path:
    """A run folder as a run writes it: run.json, trajectories.jsonl, summary.json."""
    root.mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"format": 1, "source": source}))
    with (root / "trajectories.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps({"format": 1, "steps": 2, "prompt_tokens": 100, **r}) + "\n")
    summary = {"interrupted": False, "engine": {"name": "replay", "model": None}, "gate": {}}
    (root / "summary.json").write_text(json.dumps(summary))
    return root


def rec(task_id: str, solved: bool | None, status: str = "submitted") -> dict:
    ev = None if solved is None else {"command": "pytest", "exit_code": 0, "solved": solved}
    return {"task_id": task_id, "status": status, "eval": ev, "seconds": 1.5}


# ---- estimators ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    # Newcombe (1998), Stat. Med. 17:857, Table I, method 3 (Wilson score)
    [
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
    ],
)
def test_wilson_matches_published_intervals(k, n, low, high):
    ci = wilson(k, n)
    assert ci.estimate == k / n
    assert (round(ci.low, 4), round(ci.high, 4)) == (low, high)


def test_newcombe_unpaired_matches_the_published_example():
    # Newcombe (1998), Stat. Med. 17:873, example (a): 56/70 - 48/80, method 10
    a, b = wilson(56, 70), wilson(48, 80)
    ci = newcombe(a.estimate, (a.low, a.high), b.estimate, (b.low, b.high), phi=0.0)
    assert (round(ci.low, 4), round(ci.high, 4)) == (0.0524, 0.3339)


def test_paired_difference():
    same = paired_difference([(True, True)] * 5 + [(False, False)] * 5)
    assert same.estimate == 0 and -0.5 < same.low < 0 < same.high < 0.5
    # Altman et al., Statistics with Confidence, Table 6.2 (r=14 s=5 t=0 u=22), against a
    # line-by-line transcription of biostatUZH's confIntPairedProportion (R)
    altman = paired_difference([(True, True)] * 14 + [(True, False)] * 5 + [(False, False)] * 22)
    assert (-altman.estimate, -altman.high, -altman.low) == pytest.approx(
        _paired_reference(14, 5, 0, 22)
    )
    better = paired_difference([(False, True)] * 8 + [(True, True)] * 2)
    assert better.estimate == pytest.approx(0.8)
    assert 0 < better.low < 0.8 < better.high <= 1
    worse = paired_difference([(True, False)] * 8 + [(True, True)] * 2)
    assert (worse.estimate, worse.low, worse.high) == pytest.approx(
        (-better.estimate, -better.high, -better.low)
    )
    with pytest.raises(ValueError):
        paired_difference([])


def _paired_reference(r, s, t, u):
    n = r + s + t + u
    p1, p2 = (r + s) / n, (r + t) / n
    d = p1 - p2
    w1, w2 = wilson(r + s, n), wilson(r + t, n)
    l1, u1, l2, u2 = w1.low, w1.high, w2.low, w2.high
    a = (r + s) * (t + u) * (r + t) * (s + u)
    b = r * u - s * t
    c = b - n / 2 if b > n / 2 else (b if b < 0 else 0)
    phi = c / math.sqrt(a)
    low = d - math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    high = d + math.sqrt((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2)
    return d, low, high


def test_pass_at_k_unbiased():
    assert pass_at_k(5, 0, 1) == 0 and pass_at_k(5, 5, 3) == 1
    assert pass_at_k(2, 1, 1) == 0.5
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    assert pass_at_k_mean([(4, 1), (4, 0)], 1) == pytest.approx(0.125)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


# ---- one run ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory) -> Path:
    """A real (simulated-engine) run folder."""
    out = tmp_path_factory.mktemp("r") / "sim"
    subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "--engine", "sim", "--workload", "tiny",
         "--sim-deployment", "tiny-cpu", "--out", str(out), "-q"],
        cwd=ROOT, check=True, timeout=300,
    )  # fmt: skip
    return out


def test_report_of_a_real_run(sim_run):
    p = report(str(sim_run))
    assert p.returncode == 0, p.stderr
    ids = [json.loads(line)["task_id"] for line in (sim_run / "trajectories.jsonl").open()]
    table = p.stdout.split("\n\n")[1].splitlines()
    assert table[0].split() == ["task", "status", "steps", "prompt", "tok", "gen", "tok",
                                "hit", "seconds", "result"]  # fmt: skip
    assert sorted(line.split()[0] for line in table[1:]) == sorted(ids)
    assert "solve rate: no task was evaluated" in p.stdout
    assert "engine sim (tiny-cpu)" in p.stdout and "gate wset2" in p.stdout
    j = json.loads(report(str(sim_run), "--json").stdout)
    run = j["runs"][0]
    summary = json.loads((sim_run / "summary.json").read_text())
    assert run["tasks"] == summary["tasks"] and run["by_status"] == summary["agents_by_status"]
    assert run["figures"]["steps"] == summary["steps"]
    assert sum(r["steps"] for r in run["rows"]) == summary["steps"]


def test_solve_rate_reward_and_pass_at_k(tmp_path):
    records = [rec(f"t{i}#{k}", solved=(i == 0 or k == 0)) for i in range(3) for k in range(3)]
    records.append({**rec("g#0", True), "reward": 0.25})
    records.append(rec("g#1", False))
    r = write_run(tmp_path / "a", records)
    j = json.loads(report(str(r), "--json").stdout)["runs"][0]
    rate = j["solve_rate"]
    # g#0's eval passed: solved, whatever its graded reward
    assert (rate["solved"], rate["scored"]) == (6, 11)
    assert rate["estimate"] == 6 / 11 and (rate["low"], rate["high"]) == pytest.approx(
        (wilson(6, 11).low, wilson(6, 11).high)
    )
    # per task (n, c): t0 (3, 3), t1 (3, 1), t2 (3, 1), g (2, 1): k = 1, 2 (the fewest samples)
    expect = [pass_at_k_mean([(3, 3), (3, 1), (3, 1), (2, 1)], k) for k in (1, 2)]
    assert j["pass_at_k"] == {"pass@1": round(expect[0], 4), "pass@2": round(expect[1], 4)}
    assert j["mean_reward"] == pytest.approx((9 * 5 / 9 + 0.25) / 11)
    text = report(str(r)).stdout
    assert "solve rate 6/11 = 54.5%" in text and "pass@1 " in text and "0.250" in text


# ---- comparisons ----------------------------------------------------------------------------


def test_compare_two_runs(tmp_path):
    a = write_run(tmp_path / "a", [rec("x", True), rec("y", False), rec("z", False)])
    b = write_run(tmp_path / "b", [rec("x", True), rec("y", True), rec("z", None, "error")])
    p = report(str(a), str(b))
    assert p.returncode == 0, p.stderr
    assert "2 changed outcome" in p.stdout
    assert any(line.split() == ["y", "failed", "->", "solved"] for line in p.stdout.splitlines())
    assert any(line.split() == ["z", "failed", "->", "error"] for line in p.stdout.splitlines())
    c = json.loads(report(str(a), str(b), "--json").stdout)["comparisons"][0]
    assert c["paired_scored"] == 2
    assert c["rate_difference"] == paired_difference([(True, True), (False, True)]).to_json()


def test_compare_runs_of_different_datasets_fails(tmp_path):
    a = write_run(tmp_path / "a", [rec("0", True)], source="tasks/one.jsonl")
    b = write_run(tmp_path / "b", [rec("0", True)], source="tasks/other.jsonl")
    p = report(str(a), str(b))
    assert p.returncode == 2
    assert "different datasets" in p.stderr and "one.jsonl" in p.stderr
    assert "other.jsonl" in p.stderr


# ---- bad input --------------------------------------------------------------------------------


def test_missing_run_folder(tmp_path):
    p = report(str(tmp_path / "nope"))
    assert p.returncode == 2 and f"{tmp_path / 'nope'}: no such run folder" in p.stderr
    (tmp_path / "empty").mkdir()
    p = report(str(tmp_path / "empty"))
    assert p.returncode == 2 and "no trajectories.jsonl" in p.stderr


def test_corrupt_run_folder_names_file_and_line(tmp_path):
    r = write_run(tmp_path / "a", [rec("x", True), rec("y", True)])
    lines = (r / "trajectories.jsonl").read_text().splitlines(keepends=True)
    (r / "trajectories.jsonl").write_text(lines[0] + "{not json\n" + lines[1])
    p = report(str(r))
    assert p.returncode == 2 and f"{r / 'trajectories.jsonl'}:2: not a JSON record" in p.stderr
    r2 = write_run(tmp_path / "b", [rec("x", True)])
    (r2 / "summary.json").write_text("{")
    p = report(str(r2))
    assert p.returncode == 2 and f"{r2 / 'summary.json'}: cannot read it" in p.stderr


def test_torn_last_line_is_left_out_with_a_note(tmp_path):
    r = write_run(tmp_path / "a", [rec("x", True)])
    with (r / "trajectories.jsonl").open("a") as f:
        f.write('{"task_id": "y", "sta')
    p = report(str(r), "--json")
    assert p.returncode == 0 and "half-written line" in p.stderr
    assert [row["task_id"] for row in json.loads(p.stdout)["runs"][0]["rows"]] == ["x"]
