"""The benchmarks' launcher, which the tests' harness also starts ranks with: results come back
as plain data only, and the rank contract the harness promises holds."""

import os
import pickle

import pytest
import torch

from signmuon.benchmarks.runtime.launch import load_result, run_distributed


class _RunsCode:
    """Unpickled, it makes the directory ``marker``: a harmless stand-in for running any code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_result_file_holding_a_pickled_object_is_refused_naming_it(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "rank0.pt"
    torch.save({"step_s": 0.1, "hook": _RunsCode(str(marker))}, path)
    with pytest.raises(pickle.UnpicklingError, match="rank0.pt"):
        load_result(str(path))
    assert not marker.exists()


def _plain_worker(rank, world_size):
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    return {"rank": rank, "env": env, "threads": torch.get_num_threads(), "x": torch.full((2,), float(rank))}


def test_plain_results_come_back_rank_0_first_with_torchrun_variables():
    results = run_distributed(_plain_worker, 2, threads=1)
    assert [r["rank"] for r in results] == [0, 1]
    assert results[1]["env"] == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert results[0]["threads"] == 1 and torch.equal(results[1]["x"], torch.ones(2))


def _object_worker(rank, world_size, marker):
    return _RunsCode(marker)


def test_a_rank_returning_an_object_fails_the_run_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError, match="plain data"):
        run_distributed(_object_worker, 1, str(marker))
    assert not marker.exists()
