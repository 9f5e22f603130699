"""A Hydra launcher that runs a multirun's simulated jobs as few compiled programs.

`jaxbatch -m hydra/launcher=vmap engine.backend=simulator engine.loop=device workload.rate=5,10,20`
composes every job as Hydra's basic launcher does. Jobs that `jaxbatch.run.sweep_key` says can
share one program (simulated on the device loop, differing only in their workloads, with as many
requests) run together first, as one vmapped device loop (`run.simulate_sweep`); then every job runs
through jaxbatch's `main` as usual, in order, which writes its directory from the result already
computed (`cli.DONE`) instead of running again. So the sweep directory, each job's files and
summary.csv are a basic multirun's. Any other job (the runner, the host loop, a lone member, a
bad config) runs, or fails, as it would under the basic launcher. A program's warm-up and wall
time are each of its members' `warmup_s` and `wall_s`; Ctrl-C is read only between jobs.
(No `from __future__ import annotations`: Hydra's plugin scan runs this module outside
sys.modules, where a dataclass cannot resolve string annotations.)
"""

import copy
import logging
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class VmapLauncherConf:
    _target_: str = "hydra_plugins.jaxbatch_launcher.vmap_launcher.VmapLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="vmap", node=VmapLauncherConf)


def run_together(jobs: dict[int, DictConfig], base_dir: Path) -> dict:
    """Results of the jobs (by job number) that could run as one program with another job."""
    from jaxbatch.config import validate
    from jaxbatch.run import simulate_sweep, sweep_key
    from jaxbatch.workload import from_config

    groups = defaultdict(list)
    for num, job in jobs.items():
        task = copy.deepcopy(job)
        with open_dict(task):
            del task["hydra"]
        try:
            cfg = OmegaConf.to_object(task)
            validate(cfg)
            workload = from_config(cfg.workload, base_dir, cfg.model.path)
        except Exception:  # noqa: BLE001  the job runs alone and reports its own error
            continue
        key = sweep_key(cfg)
        if key is not None:
            groups[key, len(workload)].append((num, cfg, workload))
    results = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        nums, cfgs, workloads = zip(*members)
        try:
            results.update(zip(nums, simulate_sweep(list(cfgs), list(workloads))))
        except Exception as err:  # noqa: BLE001  each job then runs alone, as it would anyway
            print(f"jaxbatch: jobs {list(nums)} run one by one: {err}", file=sys.stderr)
            continue
        log.info(f"Ran jobs {list(nums)} as one program")
    return results


class VmapLauncher(Launcher):
    def __init__(self) -> None:
        super().__init__()
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        from jaxbatch.cli import DONE

        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs, simulated ones together")
        jobs = {}
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(job):
                job.hydra.job.id = job.hydra.job.num = idx
            jobs[idx] = job
        DONE.update(run_together(jobs, Path.cwd()))
        runs = []
        for job in jobs.values():
            runs.append(run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                                config=job, job_dir_key="hydra.sweep.dir",
                                job_subdir_key="hydra.sweep.subdir"))  # fmt: skip
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs
