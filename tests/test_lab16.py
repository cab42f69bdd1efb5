"""Lab 16: each rule of the caching allocator's source, one small test; replays of real and fake
ledgers, deterministic; the streams the labs mark; bad input is one line and exit code 2."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli

from labkit import fake, marks
from labkit.ledger import Ledger

SCRIPT = "lab-16-caching-allocator/caching_allocator.py"
MiB, GiB = 2**20, 2**30


@pytest.fixture(scope="module")
def m():
    return load_lab(16, "allocator_model")


@pytest.fixture(scope="module")
def rp():
    return load_lab(16, "replay")


@pytest.fixture(scope="module")
def conf():
    return load_lab(16, "alloc_conf")


# ----------------------------------------------------------------------------- sizes (L2823, L3433)
def test_one_byte_reserves_a_2_mib_segment(m):
    a = m.CachingAllocator()
    b = a.malloc(1)
    assert (b.size, a.reserved, a.allocated) == (512, 2 * MiB, 512)


def test_one_mib_and_one_byte_gets_a_20_mib_segment(m):
    a = m.CachingAllocator()
    a.malloc(MiB + 1)
    assert a.reserved == 20 * MiB
    a.malloc(MiB)  # small: a segment of its own pool, 2 MiB
    assert a.reserved == 22 * MiB


def test_twelve_mib_reserves_exactly_twelve_mib(m):
    a = m.CachingAllocator()
    a.malloc(12 * MiB)
    assert a.reserved == 12 * MiB
    a.malloc(12 * MiB + 1)  # 10 MiB and more: rounded up to 2 MiB, a segment of its own
    assert a.reserved == 12 * MiB + 14 * MiB


def test_rounding_to_512_bytes_and_to_power_of_two_divisions(m, conf):
    assert [m.round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    four = conf.parse("roundup_power2_divisions:4")  # 1.2 MiB lies in [1, 2) MiB: steps of 256 KiB
    assert m.round_size(1200 * 1024, four) == 1280 * 1024
    assert m.round_size(2 * MiB, four) == 2 * MiB  # a power of two stays
    assert m.segment_size(10 * MiB - 1) == 20 * MiB and m.segment_size(10 * MiB) == 10 * MiB


# ----------------------------------------------------------------------------- best fit, split, merge
def test_best_fit_takes_the_smallest_cached_block_of_the_stream(m):
    a = m.CachingAllocator()
    big, small = a.malloc(14 * MiB), a.malloc(12 * MiB)
    a.free(big)
    a.free(small)
    b = a.malloc(11 * MiB)
    assert b.segment is small.segment and a.reserved == 26 * MiB


def test_a_remainder_below_the_split_threshold_is_not_split(m):
    a = m.CachingAllocator()
    a.free(a.malloc(12 * MiB))
    b = a.malloc(11 * MiB + MiB // 2)  # 512 KiB would remain: a large block keeps it (> 1 MiB to split)
    assert b.size == 12 * MiB and a.allocated == 12 * MiB
    a.free(b)
    c = a.malloc(10 * MiB)  # 2 MiB would remain: split
    assert c.size == 10 * MiB and c.next is not None and c.next.size == 2 * MiB
    s = m.CachingAllocator()
    s.free(s.malloc(4096))
    assert s.malloc(512).next.size == 2 * MiB - 512  # the small pool splits down to 512 B


def test_a_free_merges_with_its_free_neighbours(m):
    a = m.CachingAllocator()
    x, y, z = (a.malloc(3 * MiB) for _ in range(3))
    assert [[b.size for b in run] for run in a.blocks()] == [[3 * MiB, 3 * MiB, 3 * MiB, 11 * MiB]]
    a.free(x)
    a.free(z)  # merges with the 11 MiB rest after it
    assert [[(b.size, b.allocated) for b in run] for run in a.blocks()] == [
        [(3 * MiB, False), (3 * MiB, True), (14 * MiB, False)]]
    a.free(y)
    assert [[(b.size, b.allocated) for b in run] for run in a.blocks()] == [[(20 * MiB, False)]]


# ----------------------------------------------------------------------------- streams
def test_every_stream_has_its_own_pool(m):
    a = m.CachingAllocator()
    a.free(a.malloc(12 * MiB, "copy"))
    a.malloc(12 * MiB, "default")  # the copy stream's cached block is not the default stream's
    assert a.reserved == 24 * MiB
    assert a.reserved_by_stream() == {"copy": 12 * MiB, "default": 12 * MiB}


def test_a_block_used_on_another_stream_is_not_reused_before_its_event(m):
    a = m.CachingAllocator()
    x = a.malloc(12 * MiB)
    a.record_stream(x, "nccl")
    a.free(x)
    a.malloc(12 * MiB)  # the event has not completed: a new segment
    assert a.reserved == 24 * MiB
    a.complete_events("nccl")
    y = a.malloc(12 * MiB)  # processed at this malloc: x's block is free again, and reused
    assert a.reserved == 24 * MiB and y.segment is x.segment


# ----------------------------------------------------------------------------- the out-of-memory path
def test_at_capacity_out_of_memory_comes_only_after_the_retry(m):
    a = m.CachingAllocator(capacity=100 * MiB)
    a.free(a.malloc(60 * MiB))  # cached
    b = a.malloc(70 * MiB)  # cudaMalloc fails; the cache is released; the retry succeeds
    assert (a.retries, a.reserved, b.size) == (1, 70 * MiB, 70 * MiB)
    with pytest.raises(m.OutOfMemory) as err:
        a.malloc(40 * MiB)  # no cached block to release: the retry fails too
    assert a.retries == 2 and a.ooms == 1
    assert err.value.numbers == {"request": 40 * MiB, "capacity": 100 * MiB, "free": 30 * MiB, "process": 70 * MiB,
                                 "allowed": None, "allocated": 70 * MiB, "reserved": 70 * MiB, "unallocated": 0}
    assert str(err.value).startswith("CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total capacity "
                                     "of 100.00 MiB of which 30.00 MiB is free.")


def test_the_message_reads_back_through_lab12s_reader(m):
    reader = load_lab(12, "oom_reader")
    a = m.CachingAllocator(m.Options(memory_fraction=0.5), capacity=2 * GiB, outside=100 * MiB)
    a.free(a.malloc(1020 * MiB))  # Lab 12's pattern: one big block, cached, carved into 20 MiB pieces
    held = [a.malloc(20 * MiB) for _ in range(51)]
    for b in held[::2]:
        a.free(b)
    with pytest.raises(m.OutOfMemory) as err:
        a.malloc(40 * MiB)
    values = reader.read_oom(str(err.value))["values"]
    n = err.value.numbers
    assert values["request"] == n["request"] and values["allowed"] == 1 * GiB
    assert abs(values["unallocated"] - n["unallocated"]) <= 0.005 * MiB


def test_format_size_is_c10s(m):
    assert [m.format_size(n) for n in (1024, 1025, MiB, MiB + 1, GiB, 3 * GiB // 2)] == [
        "1024 bytes", "1.00 KiB", "1024.00 KiB", "1.00 MiB", "1024.00 MiB", "1.50 GiB"]


def test_max_split_size_keeps_oversize_blocks_whole_and_frees_them_first(m, conf):
    o = conf.parse("max_split_size_mb:20")
    a = m.CachingAllocator(o, capacity=100 * MiB)
    x, y = a.malloc(30 * MiB), a.malloc(30 * MiB)
    a.free(x)
    a.free(y)
    small = a.malloc(12 * MiB)  # a block >= max_split_size is not handed to a smaller request (L3489)
    assert small.segment.size == 12 * MiB and a.reserved == 72 * MiB
    whole = a.malloc(26 * MiB)  # within max_non_split_rounding (20 MiB) of a 30 MiB block: it, unsplit
    assert whole.size == 30 * MiB and whole.next is None
    a.free(whole)
    a.malloc(50 * MiB)  # cudaMalloc fails; the oversize blocks go, largest first, and no full retry (L3718)
    assert a.reserved == 62 * MiB and a.retries == 0


def test_garbage_collection_frees_old_cached_blocks_under_a_fraction(m, conf):
    o = conf.parse("garbage_collection_threshold:0.5,per_process_memory_fraction:0.5")
    a = m.CachingAllocator(o, capacity=200 * MiB)  # allowed: 100 MiB; collect above 50 MiB reserved
    for _ in range(3):
        a.free(a.malloc(20 * MiB))
        a.malloc(12 * MiB)  # the 20 MiB block is split: it stays
    before = a.reserved
    a.free(a.malloc(30 * MiB))
    a.malloc(32 * MiB)  # over the threshold: cached unsplit blocks go before cudaMalloc
    assert before + 30 * MiB > 50 * MiB and a.reserved < before + 30 * MiB + 32 * MiB


def test_empty_cache_returns_only_segments_without_live_blocks(m):
    a = m.CachingAllocator()
    keep = a.malloc(4 * MiB)
    a.free(a.malloc(4 * MiB))  # shares keep's 20 MiB segment
    a.free(a.malloc(30 * MiB))
    a.empty_cache()
    assert a.reserved == 20 * MiB and keep.allocated


def test_expandable_segments_avoid_the_oom_of_a_growing_batch(rp, conf):
    """The pattern of PyTorch's note [Expandable Segments] (CUDACachingAllocator.cpp L252-280) and of its
    CUDA semantics page: a batch one sample larger each step. Lab 12's workload, traced, on a GPU as
    large as its live peak: the native allocator retries six times, then fails; expandable segments fit."""
    lab16 = load_lab(16)
    ev = lab16.changing_batch(lab16.Config(device="cpu", iters=8))
    live = rp.replay(ev, conf.parse("")).peak_traced
    native = rp.replay(ev, conf.parse(""), capacity=live)
    grown = rp.replay(ev, conf.parse("expandable_segments:True"), capacity=live)
    assert native.oom is not None and native.retries > 1 and grown.oom is None
    assert grown.peak_reserved == live  # 20 MiB pages, tiled by requests of 2 MiB multiples


# ----------------------------------------------------------------------------- replays
def workload(device="cpu"):
    x = [torch.empty(n * 1000 + 7, device=device) for n in range(1, 40)]
    del x[::3]
    with marks.stream("copy"):
        y = torch.empty(3 * MiB // 4, device=device)
    x.append(torch.empty(5 * MiB, device=device))
    del y
    return x


def test_a_replay_of_real_tensors_equals_the_replay_of_fake_ones(rp, conf):
    with Ledger("cpu") as real:
        workload()
    with fake.tensors(), Ledger("cpu") as traced:
        workload()
    a, b = rp.replay(rp.events_of(real), conf.parse("")), rp.replay(rp.events_of(traced), conf.parse(""))
    assert a.reserved == b.reserved and a.allocated == b.allocated and a.by_stream == b.by_stream
    assert set(a.by_stream) == {"default", "copy"}


def test_the_simulation_is_deterministic(rp, conf):
    lab16 = load_lab(16)
    ev = lab16.capped(lab16.Config(device="cpu", workload="fragmented"))
    runs = [rp.replay(ev, conf.parse(c), capacity=80 * GiB) for c in ("", "", "expandable_segments:True") * 2]
    assert runs[0].reserved == runs[1].reserved and runs[0].segments() == runs[1].segments()
    assert runs[2].segments() == runs[5].segments()


def test_a_ledger_file_replays_as_the_ledger(rp, conf, tmp_path):
    with fake.tensors(), Ledger("cpu") as ledger:
        workload()
    ev = rp.events_of(ledger)
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps(rp.export_events(ev)), encoding="utf-8")
    assert rp.replay(rp.load(path), conf.parse("")).reserved == rp.replay(ev, conf.parse("")).reserved


def test_streams_are_marked_and_uses_recorded():
    with fake.tensors(), Ledger("cpu") as ledger:
        a = torch.empty(100)
        with marks.stream("copy"):
            b = torch.empty(100)
        marks.on_stream(a, "fsdp_all_gather")
        marks.record_stream(b, "nccl")
        marks.record_stream(a, "fsdp_all_gather")  # its own stream: no use to wait for
    recs = {ledger.storage_id(t): ledger.records[ledger.storage_id(t)] for t in (a, b)}
    assert [(r.stream, r.uses) for r in recs.values()] == [("fsdp_all_gather", frozenset()),
                                                            ("copy", frozenset({"nccl"}))]


def test_fsdp2s_collectives_land_in_their_streams_pools(rp, conf):
    """Lab 13's ZeRO-3 trace: the all-gather outputs on FSDP2's copy-in stream, the reduce-scatter
    outputs (the sharded gradients) on its reduce-scatter stream, as the GPU code allocates them."""
    lab13 = load_lab(13)
    tr = lab13.trace(lab13.Config(model="small-llama", seq=32, batch=2, dp=2, zero_stage=3, levers="none"))
    ev = rp.events_of(tr.ledger)
    streams = {s.stream for s in ev.storages.values()}
    assert {"default", "fsdp_all_gather", "fsdp_reduce_scatter"} <= streams
    r = rp.replay(ev, conf.parse(""))
    assert set(r.by_stream) == {"default", "fsdp_all_gather", "fsdp_reduce_scatter"}
    assert r.peak_reserved >= r.peak_allocated >= r.peak_traced


# ----------------------------------------------------------------------------- the command line
def test_the_default_run_prints_both_allocators():
    proc = run_cli(SCRIPT, "--device", "cpu", "--iters", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    runs = {r["setting"]: r for r in out["runs"]}
    assert set(runs) == {"default", "expandable_segments:True"}
    assert runs["default"]["peak_reserved_bytes"] > runs["expandable_segments:True"]["peak_reserved_bytes"]
    assert [row["iteration"] for row in out["iterations"]] == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def lab16():
    return load_lab(16)


@pytest.mark.parametrize(("args", "says"), [
    (["--alloc-conf", "max_split_size_mb:8"], "max_split_size_mb too small"),
    (["--alloc-conf", "expandable_segments:True,expandable_segments:False"], "given twice"),
    (["--alloc-conf", "no_such_key:1"], "unrecognized key"),
    (["--capacity", "1MiB"], "not one 2 MiB segment"),
    (["--workload", "fragmented", "--capacity", "1GiB"], "--cap-mb 1024 is more than"),
])
def test_bad_allocator_options_are_one_line(lab16, capsys, args, says):
    assert_usage_error_in_process(lab16, ["--device", "cpu", *args], capsys, says)


def test_a_contradictory_setting_is_one_line_from_the_shell():
    assert_clean_usage_error(run_cli(SCRIPT, "--device", "cpu", "--alloc-conf", "garbage_collection_threshold:0.5"),
                             "contradicts itself")


def test_a_file_that_is_not_a_ledger_is_one_line(lab16, capsys, tmp_path):
    bad = tmp_path / "not-a-ledger.json"
    bad.write_text(json.dumps({"events": []}), encoding="utf-8")
    assert_usage_error_in_process(lab16, ["--device", "cpu", "--ledger", str(bad)], capsys, "not a ledger file")
    worse = tmp_path / "binary.json"
    worse.write_bytes(b"\x80\x81not json")
    assert_usage_error_in_process(lab16, ["--device", "cpu", "--ledger", str(worse)], capsys, "not a ledger file")
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"format": "infralab-ledger/1", "storages": {}, "events": [["alloc", 3, 10]],
                                  "first_phase": 0, "boundaries": [], "initial": []}), encoding="utf-8")
    assert_usage_error_in_process(lab16, ["--device", "cpu", "--ledger", str(broken)], capsys, "not a valid one")


@pytest.mark.cuda
def test_the_simulation_matches_the_real_allocator_on_a_gpu():
    """On a GPU: Lab 12's growing batch, each setting in a fresh process, against the replay of its trace,
    batch by batch: reserved within 2 %."""
    lab16 = load_lab(16)
    result = lab16.run(lab16.Config(device="cuda", iters=6))
    for sim, real in zip(result.runs, result.measured["runs"]):
        for row, measured in zip(result.iterations, real["rows"]):
            assert abs(row[sim.setting]["reserved"] - measured["reserved"]) <= 0.02 * measured["reserved"]
