"""`patchswarm swarm init | issue`: the swarm's trust (trainer key, CA, member certificates)."""

from __future__ import annotations

import argparse

from patchswarm.node.cli import command
from patchswarm.protocol.errors import UsageError


def _swarm_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="swarm_command", metavar="ACTION", required=True)
    init = sub.add_parser("init", help="create a swarm: trainer key and CA", description="create a swarm: trainer key and CA")
    init.add_argument("dir", metavar="DIR", help="swarm directory to create (refuses to overwrite keys)")
    iss = sub.add_parser("issue", help="issue a member certificate signed by the swarm CA",
                         description="issue a member certificate signed by the swarm CA")
    iss.add_argument("dir", metavar="DIR", help="swarm directory (from `swarm init`)")
    iss.add_argument("name", metavar="NAME", help="member name (DNS name, certificate CN)")
    iss.add_argument("--role", required=True, choices=["tracker", "origin", "node"], help="member role")
    iss.add_argument("-o", "--output", metavar="OUT", required=True, help="credentials directory to write")
    iss.add_argument("--rotate", action="store_true",
                     help="NAME already has a certificate: issue a new one and revoke the old (names are unique)")
    iss.add_argument("--region", metavar="REGION", default=None,
                     help="bind the member to REGION: its Hello must say REGION (its --region), or the tracker and "
                          "its peers refuse it (default: none, the member says its region; with --rotate: the "
                          "region of the certificate it replaces, '' for none)")
    rev = sub.add_parser("revoke", help="revoke every certificate of a member",
                         description="revoke every certificate of a member; writes DIR/revocations, which the "
                                     "tracker (--revocations) hands to every member within a second or two")
    rev.add_argument("dir", metavar="DIR", help="swarm directory (from `swarm init`)")
    rev.add_argument("name", metavar="NAME", help="member name")


@command("swarm", "manage swarm trust: `swarm init DIR`, `swarm issue DIR NAME --role R -o OUT [--region REGION] "
                  "[--rotate]`, "
                  "`swarm revoke DIR NAME`", _swarm_args)
def cmd_swarm(args: argparse.Namespace) -> int:
    from patchswarm.node.net import trust

    if args.swarm_command == "init":
        trust.init_swarm(args.dir)
        print(f"{args.dir}: new swarm, wrote {trust.TRAINER_KEY}, {trust.TRAINER_PUB}, {trust.CA_KEY}, {trust.CA_CRT}")
        return 0
    if args.swarm_command == "issue":
        paths = trust.issue(args.dir, args.name, args.role, args.output, rotate=args.rotate, region=args.region)
        region = trust.Credentials.load(args.output).region
        print(f"{args.output}: issued {args.name!r} ({args.role}"
              f"{f', region {region!r}' if region else ', no region'}), wrote {paths['crt'].name}, "
              f"{paths['key'].name}, {trust.CA_CRT}, {trust.TRAINER_PUB}")
        if "revocations" in paths:
            print(f"{paths['revocations']}: the old certificate is revoked; give this file to the tracker "
                  f"(--revocations)")
        return 0
    if args.swarm_command == "revoke":
        path = trust.revoke(args.dir, args.name)
        print(f"{path}: {args.name!r} revoked; give this file to the tracker (--revocations)")
        return 0
    raise UsageError(f"swarm: unknown action {args.swarm_command!r}")
