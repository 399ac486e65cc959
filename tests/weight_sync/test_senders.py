"""Several senders (moe_async/weight_sync/senders.py): who sends what, and the walk of the
global bucket order by every rank (2 gloo processes, synthetic shards: no Megatron)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from moe_async.weight_sync.senders import assign_senders, make_sender_plan
from moe_async.weight_sync.stream_export import make_plan


def _meta(name, full, off, shape, dt="torch.float32"):
    return (name, tuple(full), tuple(off), tuple(shape), dt)


def _ident(name, t):
    return [(name, t)]


def _gate_up(name, t):  # a row split, as a SwiGLU fc1's gate;up
    h = t.shape[0] // 2
    return [(f"{name}.gate", t[:h]), (f"{name}.up", t[h:])]


def _ep2():
    """EP2 + DP: rank 0 holds experts 0-1 and the shared tensors' primary shards, rank 1 experts 2-3."""
    shared = [_meta("emb", (16, 8), (0, 0), (16, 8)), _meta("norm", (8,), (0,), (8,))]
    experts = [[_meta(f"e{e}.fc1", (8, 8), (0, 0), (8, 8)) for e in es] for es in ((0, 1), (2, 3))]
    return [shared + experts[0], experts[1]]


def test_experts_leave_the_rank_that_owns_them_and_each_stage_its_layers():
    owner = assign_senders(_ep2())
    assert owner == {"emb": 0, "norm": 0, "e0.fc1": 0, "e1.fc1": 0, "e2.fc1": 1, "e3.fc1": 1}
    pp2 = [[_meta(f"layers.{i}.w", (4, 4), (0, 0), (4, 4)) for i in r] for r in ((0, 1), (2, 3))]
    assert assign_senders(pp2) == {"layers.0.w": 0, "layers.1.w": 0, "layers.2.w": 1, "layers.3.w": 1}


def test_tensor_parallel_pieces_are_sent_once_by_one_rank_of_the_group_spread_over_it():
    # four TP2-split tensors of 256 B + one replicated norm (primary on TP rank 0 only)
    tp = [[_meta(f"w{i}", (8, 8), (4 * r, 0), (4, 8)) for i in range(4)] for r in (0, 1)]
    tp[0].append(_meta("norm", (8,), (0,), (8,)))
    owner = assign_senders(tp)
    assert owner["norm"] == 0
    # the held norm (32 B) counted first, then each split tensor to the least loaded holder
    assert owner == {"norm": 0, "w0": 1, "w1": 0, "w2": 1, "w3": 0}


def test_data_parallel_replicas_share_the_sending_each_tensor_once_balanced_within_one_tensor():
    # DP2 of a dense model: both ranks hold every tensor whole (rank 1's are replicas)
    sizes = [(64, 8), (8,), (32, 8), (16, 8), (48, 8), (8, 8), (4,), (24, 8)]
    dp2 = [[_meta(f"t{i}", s, (0,) * len(s), s) for i, s in enumerate(sizes)] for _ in (0, 1)]
    owner = assign_senders(dp2)
    assert set(owner) == {f"t{i}" for i in range(len(sizes))} and set(owner.values()) == {0, 1}
    plan = make_sender_plan(dp2, _ident, 1024)
    sent = plan.sent_bytes
    largest = max(4 * torch.Size(s).numel() for s in sizes)
    assert abs(sent[0] - sent[1]) <= largest and sum(sent.values()) == 4 * sum(torch.Size(s).numel() for s in sizes)
    names = [p.hf_name for sp in plan.plans.values() for b in sp.buckets for p in b]
    assert sorted(names) == sorted(owner) and len(names) == len(set(names))  # each tensor exactly once
    for s_, sp in plan.plans.items():  # read from the sender's own replica: nothing gathered
        assert all(src.rank == s_ for t in sp.tensors for src in t.sources)


def test_tp2_dp2_split_tensors_spread_over_both_tp_groups_gathered_inside_the_senders_group():
    """TP2 x DP2 on 4 ranks, holders from Megatron-Core's RankGenerator (order tp-cp-ep-dp-pp):
    the TP-split tensors are sent by ranks of both TP groups, each gathering the other half
    from its own TP group; the norms (whole on every rank) by any rank."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    tp_groups = gen.get_ranks("tp")
    assert sorted(map(sorted, tp_groups)) == [[0, 1], [2, 3]]
    meta: list[list[tuple]] = [[] for _ in range(4)]
    for g in tp_groups:
        for k, r in enumerate(sorted(g)):
            meta[r] += [_meta(f"w{i}", (8, 8), (4 * k, 0), (4, 8)) for i in range(8)]
            meta[r].append(_meta("norm", (8,), (0,), (8,)))
    plan = make_sender_plan(meta, _ident, 512)
    assert set(plan.sent_bytes) == {0, 1, 2, 3}  # every rank sends (only 0 and 1 did before)
    assert max(plan.sent_bytes.values()) - min(plan.sent_bytes.values()) <= 256
    group_of = {r: frozenset(g) for g in tp_groups for r in g}
    seen = []
    for s_, sp in plan.plans.items():
        for t in sp.tensors:
            seen.append(t.name)
            assert {src.rank for src in t.sources} <= group_of[s_], (t.name, s_)  # gathered inside its TP group
            assert s_ in {src.rank for src in t.sources}  # the sender's own half
    assert sorted(seen) == sorted({m[0] for m in meta[0]})


def test_sender_plans_partition_the_single_sender_plan_and_interleave_their_buckets():
    meta = _ep2()
    one = make_plan(meta, _gate_up, 256)
    plan = make_sender_plan(meta, _gate_up, 256)
    parts = sorted((p.hf_name, p.shape) for b in one.buckets for p in b)
    split = sorted((p.hf_name, p.shape) for s in plan.plans.values() for b in s.buckets for p in b)
    assert split == parts  # every HF tensor exactly once, by one sender
    assert plan.total_bytes == one.total_bytes == sum(plan.sent_bytes.values())
    assert plan.sent_bytes == {0: 16 * 8 * 4 + 8 * 4 + 2 * 256, 1: 2 * 256}
    # round robin: bucket b of every sender before bucket b + 1 of any
    assert plan.order[:2] == [(0, 0), (1, 0)]
    assert [b for _, b in plan.order] == sorted(b for _, b in plan.order)
    assert plan.lower_bound_s(1e3) == pytest.approx(plan.sent_bytes[0] / 1e3)
    with pytest.raises(KeyError, match=r"missing \['gone'\]"):
        make_sender_plan(meta, _gate_up, 256, expected={"gone", "emb"})


# ------------------------------------------------------------------ 2 processes, gloo
class _P:
    def __init__(self, name, data, full, off):
        self.name, self.data, self.full_shape, self.offset = name, data, tuple(full), tuple(off)


def _full():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 6, generator=g), "v": torch.randn(6, 4, generator=g),
            "e0": torch.randn(4, 6, generator=g), "e1": torch.randn(4, 6, generator=g),
            "n": torch.randn(6, generator=g)}


def _pieces(rank):
    f = _full()
    ps = [_P("w", f["w"][4 * rank: 4 * rank + 4].clone(), (8, 6), (4 * rank, 0)),  # TP rows
          _P("v", f["v"][:, 2 * rank: 2 * rank + 2].clone(), (6, 4), (0, 2 * rank)),  # TP columns
          _P(f"e{rank}", f[f"e{rank}"].clone(), (4, 6), (0, 0))]  # an expert per EP rank
    if rank == 0:
        ps.append(_P("n", f["n"].clone(), (6,), (0,)))
    return ps


def _walk(rank, port, out):
    import torch.distributed as dist

    from moe_async.weight_sync.senders import gather_sender_plan, sender_buckets
    from moe_async.weight_sync.stream_export import _typed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        pieces = _pieces(rank)
        plan = gather_sender_plan(pieces, _gate_up, 96, direct=lambda n: n != "v")
        got, seen = {}, []
        mine = iter([b for s, b in plan.order if s == rank])
        for it in sender_buckets(plan, pieces, _gate_up):
            seen.append((it.sender, it.bucket.names, it.flat is not None, it.last))
            if it.flat is not None:
                for p in plan.plans[rank].buckets[next(mine)]:
                    got[p.hf_name] = _typed(it.flat, p).clone()
        out[rank] = {"got": got, "seen": seen, "order": plan.order}
    finally:
        dist.destroy_process_group()


def _run(rank, port, q):
    out: dict = {}
    try:
        import io

        _walk(rank, port, out)
        buf = io.BytesIO()
        torch.save(out[rank], buf)  # bytes: the process may end before shared tensors are read
        q.put((rank, buf.getvalue()))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, repr(e)))


def test_every_rank_sends_its_own_buckets_bit_exact_over_gloo():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    import io

    res = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert all(isinstance(r, bytes) for r in res.values()), res
    res = {r: torch.load(io.BytesIO(b)) for r, b in res.items()}
    ref = dict(kv for n, t in _full().items() for kv in _gate_up(n, t))
    r0, r1 = res[0]["got"], res[1]["got"]
    assert set(r0).isdisjoint(r1) and set(r0) | set(r1) == set(ref)  # each HF tensor once
    for n, t in {**r0, **r1}.items():
        assert torch.equal(t, ref[n]), n
    assert {"e0.gate", "n.gate"} <= set(r0) and {"e1.gate", "e1.up"} <= set(r1)  # experts by their owner
    assert any(n.startswith(("w.", "v.")) for n in r1)  # a split tensor sent by rank 1 of the TP group
    # rank 0 sees every bucket of the global order (posts them), rank 1 only its own
    assert [(s, last) for s, _, _, last in res[0]["seen"]] == [(s, k == len(res[0]["order"]) - 1)
                                                                 for k, (s, _) in enumerate(res[0]["order"])]
    assert all(s == 1 and has for s, _, has, _ in res[1]["seen"])
    assert all(has == (s == 0) for s, _, has, _ in res[0]["seen"])


class _Source:
    """A ShardSource over _pieces (the family's split: _gate_up)."""

    expected = frozenset({"w", "v", "e0", "e1", "n"})
    vocab: dict = {}

    def __init__(self, rank):
        self._pieces = _pieces(rank)

    def check(self):
        pass

    def shards(self):
        return self._pieces

    def convert(self, name, t):
        return _gate_up(name, t)

    def direct(self, name):
        return False


class _Posting:
    """Rank 0's transport stand-in: walks the export (every bucket posted, none broadcast)."""

    group_name = "g"

    def send(self, export, version):
        n = sum(1 for _ in export.open(96, device=torch.device("cpu"), order=None, overlap=False, stats={}))
        return {"sync/buckets": float(n)}


def _lost_send(export, version):
    """Rank 0's ``send_or_lost`` stand-in: the walk fails, and engine e1 no longer answers."""
    from moe_async.weight_sync.outcome import SyncOutcome

    try:
        return _Posting().send(export, version)
    except Exception as e:  # noqa: BLE001
        return SyncOutcome({"sync/engines_lost": 1.0}, ["http://e1"], f"{type(e).__name__}: {e}")


def _agree(rank, port, q, lost=False):
    import torch.distributed as dist

    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.senders import SenderLink, sync_from_senders

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # rank 1's link never formed its group: its broadcasts fail, its pieces still reach rank 0
        link = None if rank == 0 else SenderLink([], WeightSyncConfig(bucket_bytes=96, backend="gloo"), rank=1)
        try:
            out = sync_from_senders(rank, _Source(rank), 1, transport=_Posting() if rank == 0 else None, link=link,
                                    send=_lost_send if lost else None)
            q.put((rank, f"no error: {out!r}"))
        except Exception as e:  # noqa: BLE001
            q.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def _two(lost=False) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_agree, args=(r, port, q, lost)) for r in (0, 1)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return res


def test_an_engine_lost_on_rank_0_is_every_ranks_outcome_not_an_error():
    res = _two(lost=True)
    for r in (0, 1):  # as send_or_lost on one sender: reported (the caller recovers), on every rank alike
        assert res[r].startswith("no error: SyncOutcome(metrics="), res
        assert "lost=['http://e1']" in res[r] and "rank 1: RuntimeError: sender 1: no update group" in res[r], res
    assert "'sync/engines_lost': 1.0" in res[0] and "metrics={}" in res[1]


def test_one_failing_sender_fails_the_sync_on_every_rank():
    res = _two()
    for r in (0, 1):  # both ranks fail, naming rank 1's error; rank 0 posted nothing of rank 1's (told in turn)
        assert res[r].startswith("WeightSyncError: weight sync failed on rank 0: WeightSyncError: sender 1 cannot "
                                 "send bucket 1 of the sync"), res
        assert "; rank 1: RuntimeError: sender 1: no update group" in res[r], res


# ------------------------------------ torchrun: a MegatronTrainer's ranks into two engines
W2 = ["tp2pp1ep1", "tp1pp1ep2", "tp1pp2ep1"]


@pytest.fixture(scope="module")
def two_engines(tiny_engine):
    """The shared tiny engine and a second one serving the same checkpoint."""
    from moe_async.engines.base import make_engine
    from moe_async.engines.config import EngineConfig

    eng, model_dir = tiny_engine
    other = make_engine(EngineConfig(startup_timeout_s=180, num_threads=1, max_running_requests=16), model_dir, 0)
    other.launch()
    try:
        yield [eng.url, other.url], model_dir
    finally:
        other.shutdown()


W4 = ["tp2pp1ep2", "tp1pp1ep4"]


def _launch_layouts(two_engines, tmp, n: int, lays: list[str]) -> dict:
    import json

    from _launch import torchrun

    urls, model_dir = two_engines
    out = str(tmp / f"w{n}.json")
    torchrun(n, os.path.join(os.path.dirname(__file__), "_senders_checks.py"), ",".join(urls), model_dir, out,
             *lays, timeout=600)
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def layouts(two_engines, tmp_path_factory):
    return _launch_layouts(two_engines, tmp_path_factory.mktemp("senders"), 2, W2)


@pytest.fixture(scope="module")
def layouts4(two_engines, tmp_path_factory):
    return _launch_layouts(two_engines, tmp_path_factory.mktemp("senders4"), 4, W4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo layout checks")
@pytest.mark.parametrize("layout", W2)
def test_every_rank_sends_its_shards_and_both_engines_equal_the_trainer(layouts, layout):
    _check_layout(layouts[layout], layout, 2)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo layout checks")
@pytest.mark.parametrize("layout", W4)
def test_four_senders_into_two_engines_equal_the_trainer(layouts4, layout):
    r = layouts4[layout]
    _check_layout(r, layout, 4)
    if layout == "tp1pp1ep4":  # each EP rank sends its own expert; the dense tensors (DP4) are shared by all
        for k in range(4):
            experts = {n for n in r["senders_of"][str(k)] if ".experts." in n}
            assert experts and all(f".experts.{k}." in n for n in experts)
            assert set(r["senders_of"][str(k)]) - experts  # and some dense tensors


def _check_layout(r: dict, layout: str, world: int) -> None:
    total = sum(r["sent_bytes"].values())
    # every rank sends (at TP2 x EP2 the data-parallel replicas, ranks 2 and 3, share the dense tensors)
    assert set(r["sent_bytes"]) == {str(k) for k in range(world)}
    assert all(n > 0 for n in r["sent_bytes"].values())
    assert r["sync"]["sync/bytes"] == total  # rank 0 posted every bucket, each sent once
    for e in r["engines"]:  # the check mode on each engine: every tensor equals the trainer's
        assert "check_error" not in e, e["check_error"]
        assert e["checksums_equal"] and e["sync/check_tensors"] == r["n_tensors"] == 41
        assert e["version_after"] == r["version"] and e["changed"] > 0
        assert e["bytes_received"] == total
    mine = set(r["senders_of"]["1"])
    if layout == "tp1pp1ep2":  # rank 1's experts (2, 3) leave rank 1; the dense tensors (DP2) are shared
        experts = {n for n in r["senders_of"]["0"] + r["senders_of"]["1"] if ".experts." in n}
        assert {n for n in experts if ".experts.2." in n or ".experts.3." in n} == experts & mine
        dense0, dense1 = (set(r["senders_of"][k]) - experts for k in ("0", "1"))
        assert dense0 and dense1 and not dense0 & dense1
    if layout == "tp1pp2ep1":  # stage 1 sends layer 1 (and the final norm / output layer)
        assert all(".layers.1." in n or not n.startswith("model.layers.") for n in mine)
        assert "lm_head.weight" in mine and not any(".layers.0." in n for n in mine)
    assert len(set(r["group_names"])) == world  # one update group per rank
