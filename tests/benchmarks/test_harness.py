"""gns_kernels.benchmarks.harness: the memory probe, the interleaved schedule, the tables."""
from __future__ import annotations

import threading

import torch

from gns_kernels.benchmarks import harness


def test_live_bytes_counts_new_storages_until_freed():
    with harness.LiveBytes() as m:
        a = torch.empty(1000, dtype=torch.float32)         # 4000
        b = torch.empty(250, dtype=torch.float64)          # 2000: peak 6000
        v = a[10:].view(-1, 10)                            # views: no new memory
        a.add_(1.0)                                        # in place: none
        torch.mul(b, 2.0, out=b)                           # out=: none
        del a                                              # the view keeps a's storage
        c = torch.empty(100, dtype=torch.float32)          # 400: 6400
        del v                                              # a's storage freed: 2400
        d = torch.empty(500, dtype=torch.float32)          # 2000: 4400
    assert m.peak == 6400
    assert m.live == 4400 and m.count == 4
    del b, c, d
    assert m.live == 0


def test_live_bytes_sees_a_free_on_another_thread():
    box = []
    with harness.LiveBytes() as m:
        box.append(torch.ones(1000))                      # 4000
        t = threading.Thread(target=box.clear)            # the last reference dies there
        t.start()
        t.join()
        x = torch.ones(500)                               # 2000, not 6000
    assert m.peak == 4000 and m.live == 2000
    del x


def test_live_bytes_a_storage_resized_to_zero_is_freed():
    with harness.LiveBytes() as m:
        a = torch.empty(1000)                              # 4000
        a.untyped_storage().resize_(0)                     # freed as FSDP2 frees parameters
        b = torch.empty(500)                               # 2000, not 6000
    assert m.peak == 4000 and m.live == 2000
    del a, b


def test_live_bytes_ignores_memory_allocated_before():
    before = torch.ones(10_000)
    with harness.LiveBytes() as m:
        y = before * 2                                     # new: 40000
        before.mul_(3)
        del y
    assert m.peak == 40_000 and m.live == 0


class _State:
    def __init__(self):
        self.every, self.step, self.estimate, self.log = 1, 0, None, []


def test_interleaved_schedule_rotates_and_measures_every_F():
    states = {"l1": _State()}
    calls = []

    def step(name, around_backward=None):
        st = states.get(name)
        if st is not None:
            st.log.append((st.every, st.step % st.every == 0))
            st.step += 1
        calls.append(name)
        return float(len(calls))

    times, est = harness.interleaved_times(step, states, ["base", "l1", "x_p"], every=3, rounds=2,
                                           f1_rounds=2, f1_block=2, warmup=1, f_names=["base", "l1"])
    assert calls[:3] == ["base", "l1", "x_p"]                            # warm-up
    f_calls = calls[3:3 + 2 * 6]
    assert f_calls[:6] == ["base", "l1", "l1", "base", "base", "l1"]     # rotating order
    assert [len(times[k]) for k in ("base_F3", "l1_F3", "x_p_F3")] == [6, 6, 0]
    assert [len(times[k]) for k in ("base_F1", "l1_F1", "x_p_F1")] == [4, 4, 4]
    f1_calls = calls[15:]
    assert f1_calls[:6] == ["base", "l1", "x_p", "l1", "x_p", "base"]
    log = states["l1"].log
    assert [m for e, m in log[1:7]] == [True, False, False, True, False, False]  # steps 0 and 3 of F = 3
    assert all(e == 1 and m for e, m in log[7:])
    assert est == {"l1": None}
    # times are the step's return values, in the order each configuration ran
    assert times["l1_F3"][0] == 5.0
    # every = 1: the F = 1 rows once, not twice into the same list
    times, _ = harness.interleaved_times(step, states, ["base", "l1"], every=1, rounds=3,
                                         f1_rounds=2, f1_block=2, warmup=0)
    assert set(times) == {"base_F1", "l1_F1"} and len(times["base_F1"]) == 4


def test_tables_amortize_by_the_F_given():
    times = {"base_F1": [2.0], "l1_F1": [3.0], "s1_F1": [6.0],
             "base_F7": [2.0] * 7, "l1_F7": [2.1] * 7, "s1_F7": [2.5] * 7}
    text = harness.format_tables(times, 7, {"base": "B", "l1": "L", "s1": "S"},
                                 {"base": "base", "l1": "base", "s1": "base"}, {"l1": "l1", "s1": "S1"})
    assert "| 7 | 7 | 2.0000 | 2.1000 | +5.0% | 2.5000 | +25.0% |" in text
    assert "One S1 measurement step costs +4.0000 s over the F=1 baseline (+200.0%); / 7 = " \
           "+0.571429 s/step (+28.57% at F=7, amortized)." in text
    assert "| configuration |" not in text
