import json

import pytest

from runner.engines.chatml_tokenizer import EOS_ID, ChatMLTokenizer, span
from runner.sim.workload import SimModel, Workload, synthetic
from tests.conftest import write_jsonl


def test_sim_tokenizer_roundtrip_and_spans():
    tok = ChatMLTokenizer()
    text = 'hello  world <|im_end|>\n{"a": 1}'
    ids = tok.encode(text)
    assert tok.decode(ids) == text.replace("<|im_end|>", "")
    assert tok.token_text(ids[ids.index(EOS_ID)]) == "<|im_end|>"
    a, b = tok.encode(span(1000, 7)), tok.encode(span(1000, 8))
    assert len(a) == 1000 and len(set(a) & set(b)) == 0
    assert tok.encode(span(10, 7)) == a[:10]  # same seed: same tokens


def test_synthetic_is_seeded_and_in_range():
    w1, w2, w3 = synthetic("paper", seed=1), synthetic("paper", seed=1), synthetic("paper", seed=2)
    assert [a.steps for a in w1.agents] == [a.steps for a in w2.agents]
    assert [a.steps for a in w1.agents] != [a.steps for a in w3.agents]
    assert len(w1.agents) == 256
    for a in w1.agents:
        assert 10 <= len(a.steps) <= 50
        assert 14_000 <= a.total_tokens() <= 33_000
        assert all(1.0 <= s.tool_seconds <= 8.0 for s in a.steps[:-1])
    with pytest.raises(ValueError, match="unknown workload preset"):
        synthetic("nope")


def test_trace_file_roundtrip(tmp_path):
    w = synthetic("tiny", seed=3)
    w.save(tmp_path / "t.jsonl")
    back = Workload.load(tmp_path / "t.jsonl")
    assert back.system_tokens == w.system_tokens
    assert [a.id for a in back.agents] == [a.id for a in w.agents]
    assert [len(a.steps) for a in back.agents] == [len(a.steps) for a in w.agents]
    assert back.agents[0].steps[0].obs_tokens == w.agents[0].steps[0].obs_tokens
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "concur-trace", "version": 1}\n{"id": "x", "steps": []}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        Workload.load(bad)
    with pytest.raises(ValueError, match="not a trace file"):
        (tmp_path / "x.jsonl").write_text("{}\n")
        Workload.load(tmp_path / "x.jsonl")


def test_trace_from_real_trajectories(tmp_path):
    recs = [
        {
            "task_id": "a",
            "step_log": [
                {
                    "prompt_tokens": 500,
                    "cached_tokens": 0,
                    "completion_tokens": 40,
                    "tool_seconds": 1.5,
                },
                {
                    "prompt_tokens": 700,
                    "cached_tokens": 539,
                    "completion_tokens": 30,
                    "tool_seconds": 0.0,
                },
            ],
        },
        {
            "task_id": "b",
            "step_log": [
                {
                    "prompt_tokens": 450,
                    "cached_tokens": 300,
                    "completion_tokens": 20,
                    "tool_seconds": 2.0,
                },
            ],
        },
    ]
    p = tmp_path / "trajectories.jsonl"
    write_jsonl(p, recs)
    w = Workload.from_trajectories(p)
    assert w.system_tokens == 300
    a = w.agents[0]
    assert a.prompt_tokens == 200
    assert (a.steps[0].gen_tokens, a.steps[0].tool_seconds, a.steps[0].obs_tokens) == (40, 1.5, 160)
    assert a.steps[1].obs_tokens == 0


def test_sim_model_answers_each_step_with_the_trace():
    w = synthetic("tiny", seed=0, gen=(40, 60))
    tok = ChatMLTokenizer()
    model = SimModel(w, tok)
    task = w.tasks()[2]
    trace = w.agents[2]
    ids = tok.encode(tok.render(task.messages))
    out = model(ids)
    assert len(out) == trace.steps[0].gen_tokens and out[-1] == EOS_ID
    text = tok.decode(out[:-1])
    call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call["name"] == "sim_tool" and call["arguments"]["tokens"] == trace.steps[0].obs_tokens
    # after the last tool step the model submits
    for _ in range(len(trace.steps) - 1):
        ids = ids + out + tok.encode("\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n")
        out = model(ids)
    assert '"submit"' in tok.decode(out)


@pytest.mark.parametrize("system", [16, 0])
def test_as_sent_is_what_the_runner_sends_the_engine(tmp_path, system):
    # every request of a real simulated run, prompt and reply, step by step, is the trace
    # as sent: the runner's template and tool instructions counted; replies shorter than
    # their tool call in the trace are the call's length
    from runner.policies.registry import make_policy
    from runner.sim.engine import deployment
    from runner.sim.simulate import simulate

    w = synthetic("tiny", seed=5, agents=6, steps=(1, 8), system=system, gen=(5, 60))
    d = deployment("tiny-cpu")
    sent = w.as_sent(d.max_context, d.pool_tokens, 4096)
    assert sent is not None and sent.system_tokens > system  # the tool instructions too
    r = simulate(w, "tiny-cpu", make_policy("agent-cap:2"), tmp_path / "r")
    logs = {
        rec["task_id"]: rec["step_log"]
        for rec in map(json.loads, (tmp_path / "r" / "trajectories.jsonl").read_text().splitlines())
    }
    longer = 0
    for a, trace in zip(sent.agents, w.agents, strict=True):
        ctx, expect = sent.system_tokens + a.prompt_tokens, []
        for s, t in zip(a.steps, trace.steps, strict=True):
            expect.append((ctx, s.gen_tokens))
            ctx += s.gen_tokens + s.obs_tokens
            longer += s.gen_tokens > t.gen_tokens
            assert s.gen_tokens >= t.gen_tokens and s.tool_seconds == t.tool_seconds
        got = [(x["prompt_tokens"], x["completion_tokens"]) for x in logs[a.id]]
        assert got == expect, a.id
        assert r.work[a.id][1] == sent.system_tokens + a.total_tokens()
    assert longer  # the case is exercised
    # a later agent's first prompt is served from the shared prefix at least
    assert max(log[0]["cached_tokens"] for log in logs.values()) >= sent.system_tokens


def test_as_sent_ends_agents_where_the_runner_does_at_the_context_limit(tmp_path):
    # a context limit some agents reach: the engine refuses a prompt that leaves no room for
    # max_new, and the runner ends an agent whose next observation would not fit; the trace
    # as sent stops each agent there, request for request as a simulated run does
    from runner.policies.registry import make_policy
    from runner.sim.engine import deployment
    from runner.sim.oracle import lower_bound
    from runner.sim.simulate import simulate

    w = synthetic("tiny", seed=5, agents=6, steps=(3, 8), system=16)
    pool = deployment("tiny-cpu").pool_tokens
    full = w.as_sent(10**6, pool, 4096)
    finals = sorted(full.system_tokens + a.total_tokens() for a in full.agents)
    limit = finals[2] + 4096  # the three longest agents do not get to their end
    sent = w.as_sent(limit, pool, 4096)
    cut = [a for a, b in zip(sent.agents, full.agents, strict=True) if a.steps != b.steps]
    assert len(cut) == 3
    r = simulate(w, "tiny-cpu", make_policy("none"), tmp_path / "r",
                 engine_options={"context_limit": limit})  # fmt: skip
    logs = {
        rec["task_id"]: rec
        for rec in map(json.loads, (tmp_path / "r" / "trajectories.jsonl").read_text().splitlines())
    }
    for a in sent.agents:
        ctx, expect = sent.system_tokens + a.prompt_tokens, []
        for s in a.steps:
            expect.append((ctx, s.gen_tokens))
            ctx += s.gen_tokens + s.obs_tokens
        got = [(x["prompt_tokens"], x["completion_tokens"]) for x in logs[a.id]["step_log"]]
        assert got[: len(expect)] == expect, a.id
        assert all(x[1] == 0 for x in got[len(expect) :]), a.id  # a refused request, if any
    assert {logs[a.id]["status"] for a in cut} == {"context_limit"}
    b = lower_bound(w, "tiny-cpu", context_limit=limit)
    assert b["as_sent"] and r.sim_seconds >= b["bound_seconds"]


def test_as_sent_is_none_where_the_engine_would_cut_a_reply_short():
    from runner.sim.oracle import lower_bound

    w = synthetic("tiny", seed=5, agents=3, steps=(2, 4), gen=(20, 40))
    full = w.as_sent(10**6, 10**6, 64)
    a = full.agents[0]
    last = full.system_tokens + a.total_tokens() - a.steps[-1].gen_tokens  # its last prompt
    # the pool's longest request (pool - 1) leaves that prompt 5 tokens: admitted, but its
    # max_new clipped below its reply
    assert w.as_sent(10**6, last + 6, 64) is None
    assert lower_bound(w, "tiny-cpu", max_total_tokens=last + 6)["as_sent"] is False


def test_heavy_tools_are_pareto_from_lo_cut_at_cap_and_leave_the_rest_alone():
    base = synthetic("paper", seed=4, agents=64)
    heavy = synthetic("paper", seed=4, agents=64, heavy_tools=(1.2, 0.5, 90.0))
    times = [s.tool_seconds for a in heavy.agents for s in a.steps[:-1]]
    assert all(0.5 <= t <= 90.0 for t in times)
    assert max(times) == 90.0  # shape 1.2 over ~1,900 calls: some reach the cap
    assert sorted(times)[len(times) // 2] < 1.5  # median 0.5 x 2^(1/1.2) ~ 0.89

    # the main stream is untouched: same steps, replies and observations
    def sizes(w: Workload) -> list:
        return [[(s.gen_tokens, s.obs_tokens) for s in a.steps] for a in w.agents]

    assert sizes(base) == sizes(heavy)
