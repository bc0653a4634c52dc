"""Multi-node launch under Slurm: the torchrun command of each training node, the `aligner-ext serve`
commands of each generation node, computed from Slurm's environment (scripts/slurm/*.sbatch run this
once per node through `srun --ntasks-per-node=1`).

    python -m aligner_ext.launch.slurm train [options] -- [train overrides]
    python -m aligner_ext.launch.slurm serve [options] -- [serve overrides]
    ... --dry-run   prints the commands of every node and runs nothing

Training: `torchrun --nnodes=N --node_rank=R --nproc_per_node=G` with a c10d rendezvous at the first
node of the job (or of heterogeneous group `--het-group`). Generation servers (`serve`): one
`aligner-ext serve` per GPU of each node of their group, on ports `--port`, `--port`+1, ...; the
trainer's `--servers-het-group` adds `generator.engine=remote`, the servers' URLs and an in-memory
weight push (`weight_sync=distributed`, the store on the first training node) to the overrides, and
with `--wait-for-servers S` waits until every server answers /health.

Fails before running anything, naming what is wrong: a missing variable, a node list that does not
hold SLURM_NNODES nodes, a node id outside it, a GPU count it cannot find.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Mapping

RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class LaunchError(RuntimeError):
    """Slurm's environment does not describe a launchable job (the message names what is missing)."""


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host list ("gpu[01-03,07],cpu5") as host names, in order."""
    hosts, depth, start = [], 0, 0
    for index, char in enumerate(nodelist + ","):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            hosts += _expand_one(nodelist[start:index].strip(), nodelist)
            start = index + 1
    return hosts


def _expand_one(item: str, whole: str) -> list[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", item)
    if not match:
        if not item or "[" in item or "]" in item:
            raise LaunchError(f"cannot read the Slurm node list {whole!r} at {item!r}")
        return [item]
    prefix, ranges, suffix = match.groups()
    hosts = []
    for part in ranges.split(","):
        bounds = RANGE.match(part)
        if not bounds:
            raise LaunchError(f"cannot read the Slurm node list {whole!r} at {part!r}")
        first, last = bounds.group(1), bounds.group(2) or bounds.group(1)
        hosts += [f"{prefix}{number:0{len(first)}d}{suffix}" for number in range(int(first), int(last) + 1)]
    return hosts


@dataclass
class Group:
    """The nodes of the job (or of one heterogeneous group) and this process's node among them."""

    nodes: list[str]
    node_rank: int | None  # None when this process runs on none of them (a dry run outside the job)
    gpus_per_node: int
    job_id: str


def _required(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        if env.get(name):
            return env[name]
    raise LaunchError(f"{' or '.join(names)} is not set: run inside a Slurm allocation (sbatch / srun)")


def _gpus(env: Mapping[str, str], given: int | None, suffix: str) -> int:
    if given:
        return given
    value = env.get(f"SLURM_GPUS_ON_NODE{suffix}") or env.get(f"SLURM_GPUS_PER_NODE{suffix}")
    if not value:
        raise LaunchError("the GPUs per node are unknown: pass --gpus-per-node or ask Slurm for --gpus-per-node")
    return int(value.split(":")[-1].split("(")[0])


def group_of(env: Mapping[str, str], het_group: int | None, gpus_per_node: int | None) -> Group:
    """The nodes of the job (het_group None) or of heterogeneous group `het_group`, checked."""
    suffix = "" if het_group is None else f"_HET_GROUP_{het_group}"
    nodes = expand_nodelist(_required(env, f"SLURM_JOB_NODELIST{suffix}", *([] if suffix else ["SLURM_NODELIST"])))
    expected = env.get(f"SLURM_JOB_NUM_NODES{suffix}") or env.get(f"SLURM_NNODES{suffix}" if suffix else "SLURM_NNODES")
    if expected and int(expected) != len(nodes):
        raise LaunchError(f"the node list {env.get(f'SLURM_JOB_NODELIST{suffix}')!r} holds {len(nodes)} nodes, "
                          f"Slurm says {expected}: a node is missing")
    host = env.get("SLURMD_NODENAME")
    node_rank = nodes.index(host) if host in nodes else None
    return Group(nodes, node_rank, _gpus(env, gpus_per_node, suffix), _required(env, "SLURM_JOB_ID"))


API_KEY_ENV = "ALIGNER_EXT_API_KEY"  # the key the servers require and the trainer sends (they listen on every interface)


def server_urls(group: Group, port: int) -> list[str]:
    return [f"http://{node}:{port + gpu}" for node in group.nodes for gpu in range(group.gpus_per_node)]


def train_command(group: Group, node_rank: int, port: int, overrides: list[str]) -> list[str]:
    return ["torchrun", f"--nnodes={len(group.nodes)}", f"--node_rank={node_rank}",
            f"--nproc_per_node={group.gpus_per_node}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={group.nodes[0]}:{port}", f"--rdzv_id={group.job_id}",
            "-m", "aligner_ext", "train", *overrides]


def serve_commands(group: Group, port: int, overrides: list[str]) -> list[tuple[dict[str, str], list[str]]]:
    """(extra environment, command) of each server of one node: one per GPU."""
    return [({"CUDA_VISIBLE_DEVICES": str(gpu)},
             ["aligner-ext", "serve", "serve.host=0.0.0.0", f"serve.port={port + gpu}", f"serve.api_key_env={API_KEY_ENV}",
              *overrides])
            for gpu in range(group.gpus_per_node)]


def remote_overrides(servers: Group, server_port: int, trainer: Group, weight_port: int) -> list[str]:
    """What the trainer needs to generate on the servers and push its weights to them."""
    return ["generator.engine=remote", f"generator.remote.urls=[{','.join(server_urls(servers, server_port))}]",
            "generator.remote.weight_sync=distributed", f"generator.remote.weight_sync_address={trainer.nodes[0]}",
            f"generator.remote.weight_sync_port={weight_port}", f"generator.remote.api_key_env={API_KEY_ENV}"]


def wait_for_servers(urls: list[str], timeout_s: float) -> None:
    """Return once every server answers /health; LaunchError naming the silent ones after `timeout_s`."""
    deadline, waiting = time.monotonic() + timeout_s, list(urls)
    while waiting:
        for url in list(waiting):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    waiting.remove(url)
            except OSError:
                pass
        if waiting and time.monotonic() > deadline:
            raise LaunchError(f"generation servers not answering /health after {timeout_s:g} s: {waiting}")
        if waiting:
            time.sleep(2)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m aligner_ext.launch.slurm", description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("train", "serve"))
    parser.add_argument("--het-group", type=int, default=None, help="heterogeneous group this role runs on")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: Slurm's SLURM_GPUS_ON_NODE")
    parser.add_argument("--port", type=int, default=None,
                        help="train: rendezvous port (default 29500); serve: first server port (default 8000)")
    parser.add_argument("--servers-het-group", type=int, default=None, help="train: the servers' group")
    parser.add_argument("--server-port", type=int, default=8000, help="train: the servers' first port")
    parser.add_argument("--server-gpus-per-node", type=int, default=None, help="train: servers per generation node")
    parser.add_argument("--weight-sync-port", type=int, default=29600, help="train: port of the weight group's store")
    parser.add_argument("--wait-for-servers", type=float, default=0.0, help="train: seconds to wait for /health")
    parser.add_argument("--dry-run", action="store_true", help="print every node's commands, run nothing")
    return parser


def plan(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[Group, list[tuple[str, dict, list[str]]], list[str]]:
    """(this role's group, [(node, extra env, command)] for every node, server URLs to wait for)."""
    group = group_of(env, args.het_group, args.gpus_per_node)
    overrides, urls = list(args.overrides), []
    if args.role == "serve":
        commands = [(node, extra, command) for node in group.nodes
                    for extra, command in serve_commands(group, args.port or 8000, overrides)]
        return group, commands, urls
    if args.servers_het_group is not None:
        servers = group_of(env, args.servers_het_group, args.server_gpus_per_node)
        overrides = remote_overrides(servers, args.server_port, group, args.weight_sync_port) + overrides
        urls = server_urls(servers, args.server_port)
    commands = [(node, {}, train_command(group, rank, args.port or 29500, overrides))
                for rank, node in enumerate(group.nodes)]
    return group, commands, urls


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)  # overrides for train / serve follow `--`
    args = _parser().parse_args(argv[:split])
    args.overrides = argv[split + 1:]
    env = os.environ if env is None else env
    try:
        group, commands, urls = plan(args, env)
        if args.dry_run:
            for node, extra, command in commands:
                prefix = "".join(f"{key}={value} " for key, value in extra.items())
                print(f"[{node}] {prefix}{shlex.join(command)}")
            return 0
        if (args.role == "serve" or urls) and not env.get(API_KEY_ENV):
            raise LaunchError(f"the generation servers listen on every interface and need a key the trainer shares: "
                              f"export {API_KEY_ENV} (scripts/slurm/train_with_servers.sbatch makes one per job)")
        if group.node_rank is None:
            raise LaunchError(f"this node ({env.get('SLURMD_NODENAME')!r}) is not in the {args.role} group "
                              f"{group.nodes}: start it with srun (--het-group for a heterogeneous job)")
        if urls and args.wait_for_servers:
            wait_for_servers(urls, args.wait_for_servers)
    except LaunchError as err:
        print(f"aligner-ext launch: {err}", file=sys.stderr)
        return 2
    mine = [(extra, command) for node, extra, command in commands if node == group.nodes[group.node_rank]]
    processes = [subprocess.Popen(command, env={**env, **extra}) for extra, command in mine]
    return max(process.wait() for process in processes)


if __name__ == "__main__":
    sys.exit(main())
