"""The per-step signals between ranks, on a real two-rank gloo process group (loopback)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch.multiprocessing as mp

from toolkit.train.step_signals import LossWindow

RANKS = 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_main(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from toolkit.train.step_signals import Agreement, LossWindow

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    window, agreement = LossWindow(every=3, world=RANKS), Agreement(dist, "gloo")
    results = {"flushes": [], "agreements": []}
    for step in range(1, 7):
        loss = torch.tensor(float(step * 10 + rank))  # rank 0: 10, 20...; rank 1: 11, 21...
        accuracy = torch.tensor(0.5 * rank) if step != 5 else torch.tensor(1.0)
        norm = torch.tensor(float(step))  # the global norm: the same on every rank
        window.add(step, loss, accuracy, lr=1e-4, tokens=step * 100, grad_norm=norm)
        results["agreements"].append(agreement.agree(stop_requested=(rank == 1 and step == 4),
                                                     save_clock_due=(rank == 0 and step == 2)))
        if window.due(step):
            results["flushes"].append([(r.step, r.loss, r.accuracy, r.tokens, r.grad_norm) for r in window.read(dist)])
    results["after"] = window.read(dist)  # nothing pending: no collective, nothing read
    dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(results))


def test_ranks_read_their_losses_together_every_k_steps_and_agree_on_every_step(tmp_path):
    mp.start_processes(rank_main, args=(free_port(), str(tmp_path)), nprocs=RANKS, start_method="spawn")
    results = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(RANKS)]

    assert results[0] == results[1]  # every rank reads the same numbers
    flushes = results[0]["flushes"]
    assert [[record[0] for record in flush] for flush in flushes] == [[1, 2, 3], [4, 5, 6]]
    losses = [record[1] for flush in flushes for record in flush]
    assert losses == [step * 10 + 0.5 for step in range(1, 7)]  # the mean over both ranks
    accuracies = [record[2] for flush in flushes for record in flush]
    assert accuracies == [0.25, 0.25, 0.25, 0.25, 1.0, 0.25]
    assert [record[3] for flush in flushes for record in flush] == [100, 200, 300, 400, 500, 600]
    assert [record[4] for flush in flushes for record in flush] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert results[0]["after"] == []
    # One rank's stop request or save clock is every rank's, at the same step.
    assert results[0]["agreements"] == [[False, False], [False, True], [False, False], [True, False],
                                        [False, False], [False, False]]


def test_a_window_without_steps_reads_nothing_and_needs_no_process_group():
    window = LossWindow(every=10, world=4)
    assert window.read(dist=None) == []
    assert not window.due(9) and window.due(10) and window.due(20)
