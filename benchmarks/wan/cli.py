"""``firstbyte wan``: bring an emulated geography up and down, clean up, measure precision.

- ``up PROFILE``: namespaces and a detached forwarder for a profile (a built-in name or a TOML
  file, see :mod:`firstbyte.benchmarks.wan.geo`); prints each host's namespace and address.
- ``exec HOST -- CMD ...``: run a command inside a host of the running ``up`` emulator.
- ``status``: runs recorded in ``/run/firstbyte-wan`` and whether their owner is alive.
- ``down [RUN_ID | --all]``: tear down an ``up`` run (the only one, the one named, or all).
- ``cleanup``: tear down runs whose owning process died (crashed tests, killed benchmarks).
- ``precision [--rtt MS] [--count N]``: configured vs measured RTT through a fresh emulator.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from firstbyte.benchmarks.wan import geo, netns
from firstbyte.cli import CLIError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="wan_command", metavar="ACTION", required=True)
    up = sub.add_parser(
        "up",
        help="start an emulated geography in the background",
        description="Start an emulated geography in the background.",
    )
    up.add_argument(
        "profile", metavar="PROFILE", help=f"built-in ({', '.join(geo.BUILTIN)}) or a TOML file"
    )
    up.add_argument("--seed", type=int, default=0, help="loss PRNG seed (default 0)")
    ex = sub.add_parser(
        "exec",
        help="run a command inside a host of the running emulator",
        description="Run a command inside a host of the running emulator.",
    )
    ex.add_argument("host", help="the emulated host, e.g. client-beijing (see `wan status`)")
    ex.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    sub.add_parser(
        "status",
        help="list emulator runs on this machine",
        description="List emulator runs on this machine.",
    )
    down = sub.add_parser(
        "down",
        help="tear down emulators started with `up`",
        description="Tear down emulators started with `up`.",
    )
    down.add_argument("run_id", nargs="?", help="the run to stop (default: the only `up` run)")
    down.add_argument("--all", action="store_true", help="stop every `up` run on this machine")
    clean = sub.add_parser(
        "cleanup",
        help="remove what crashed runs left behind",
        description="Remove what crashed runs left behind.",
    )
    clean.add_argument(
        "--stale", action="store_true",
        help="only runs whose owner died: what cleanup always does (accepted for scripts)",
    )
    prec = sub.add_parser(
        "precision",
        help="configured vs measured RTT through the emulator",
        description="Configured vs measured RTT through the emulator.",
    )
    prec.add_argument("--rtt", type=float, default=150.0, help="configured RTT in ms (default 150)")
    prec.add_argument("--count", type=int, default=50, help="probes per method (default 50)")
    prec.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _capable() -> None:
    try:
        netns.check_capable()
    except netns.WanUnavailable as exc:
        raise CLIError(str(exc)) from None


def _up(args: argparse.Namespace) -> int:
    try:
        profile = geo.load_profile(args.profile)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    _capable()
    hosts = [(h.name, h.ip) for h in profile.hosts()]
    try:
        net = netns.Network.start(hosts, profile.link_params(), seed=args.seed, detached=True)
    except (netns.WanError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    state = net.state
    print(f"wan: run {state.run_id} up (forwarder pid {state.forwarder_pid})")
    print(f"{'host':<24} {'role':<8} {'address':<16} {'aws':<15} {'last mile':<10} namespace")
    for row in profile.describe():
        print(
            f"{row['name']:<24} {row['role']:<8} {row['ip']:<16} {row['aws']:<15} "
            f"{row['last_mile'] or '-':<10} {state.namespaces[row['name']]}"
        )
    sites = profile.sites
    print("\nconfigured RTT (ms):")
    for i, a in enumerate(sites):
        for b in sites[i + 1 :]:
            print(f"  {a.name} <-> {b.name}: {profile.rtt_ms(a, b):.1f}")
    print("\nrun commands with: firstbyte wan exec HOST -- CMD   (stop: firstbyte wan down)")
    return 0


def _up_runs() -> list[netns.RunState]:
    return [s for s in netns.load_states() if s.detached]


def _exec(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise CLIError("give a command: firstbyte wan exec HOST -- CMD ...")
    _capable()
    runs = [s for s in _up_runs() if s.owner_alive() and args.host in s.namespaces]
    if not runs:
        raise CLIError(f"no running emulator has a host {args.host!r} (start one with `wan up`)")
    ns = max(runs, key=lambda s: s.created).namespaces[args.host]
    os.execvp("ip", ["ip", "netns", "exec", ns, *argv])


def _status(args: argparse.Namespace) -> int:
    states = netns.load_states()
    if not states:
        print("wan: no runs recorded")
    for s in states:
        alive = "alive" if s.owner_alive() else "DEAD (firstbyte wan cleanup removes it)"
        kind = "up" if s.detached else "in-process"
        print(
            f"{s.run_id}  {kind:<10} owner pid {s.owner_pid} {alive}  hosts: "
            + ", ".join(f"{h}={ip}" for h, ip in s.ips.items())
        )
    return 0


def _down(args: argparse.Namespace) -> int:
    _capable()
    states = _up_runs()
    if args.run_id is not None:
        states = [s for s in netns.load_states() if s.run_id == args.run_id]
        if not states:
            raise CLIError(f"no run {args.run_id!r} (see firstbyte wan status)")
    elif len(states) > 1 and not args.all:
        ids = ", ".join(s.run_id for s in states)
        raise CLIError(f"several runs are up ({ids}): name one, or pass --all")
    for s in states:
        netns.teardown(s)
        print(f"wan: run {s.run_id} down")
    if not states:
        print("wan: nothing to tear down")
    return 0


def _cleanup(args: argparse.Namespace) -> int:
    _capable()
    removed = netns.cleanup_stale()
    print("wan: removed " + (", ".join(removed) if removed else "nothing (no stale runs)"))
    return 0


def _precision(args: argparse.Namespace) -> int:
    from firstbyte.benchmarks.wan.precision import MAX_MEDIAN_ERROR_MS, measure

    if not 0 <= args.rtt <= 10_000:
        raise CLIError("--rtt must be within 0..10000 ms")
    if not 1 <= args.count <= 10_000:
        raise CLIError("--count must be within 1..10000")
    _capable()
    try:
        report = measure(args.rtt, args.count)
    except netns.WanError as exc:
        raise CLIError(str(exc)) from None
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print(report.render())
        verdict = "within" if report.max_abs_error_ms <= MAX_MEDIAN_ERROR_MS else "OUTSIDE"
        print(
            f"max |median error| {report.max_abs_error_ms:.3f} ms: {verdict} the "
            f"{MAX_MEDIAN_ERROR_MS} ms bound; the emulator's own (fastest round trip) "
            f"{report.max_abs_floor_error_ms:.3f} ms"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    actions = {
        "up": _up,
        "exec": _exec,
        "status": _status,
        "down": _down,
        "cleanup": _cleanup,
        "precision": _precision,
    }
    return actions[args.wan_command](args)
