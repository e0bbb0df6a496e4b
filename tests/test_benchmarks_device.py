"""The train benchmark's evaluation keeps its collective on the group's device (see
``tests/gpu_world.py``): NCCL rejects the CPU tensor it all-reduced before."""

from signmuon.benchmarks.runs.training import mean_over_workers

from .gpu_world import gpu_world


def test_the_mean_worker_accuracy_is_reduced_on_the_group_device():
    with gpu_world(4) as world:
        mean_over_workers(0.75)
        assert not world.misplaced, world.misplaced
        assert any("benchmarks/runs/training.py" in site for site in world.reads.sites), world.reads  # it ran there
