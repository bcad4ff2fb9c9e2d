"""The local Ray of the tests (`ray_local` in tests/conftest.py), in a plain module so that a test
that connects to another cluster for a while (tests/integration/test_ray_two_nodes.py) can bring
it back when it is done."""
from __future__ import annotations


def start_local_ray() -> None:
    """A local 2-CPU Ray with Ray Data's progress output off."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _temp_dir="/tmp/ray")
    quiet_ray_data()


def quiet_ray_data() -> None:
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
