"""deploy/ judged by the tools and rules its users' platforms apply.

- Kubernetes: every manifest passes `kubernetes-validate --strict` (schemas bundled in the
  package, no network), and a lint checks what schemas cannot: namespace, hostNetwork with
  ClusterFirstWithHostNet, non-root with fsGroup, an init step owning the hostPath data dir,
  GPU toleration, resources, probes on /healthz and /readyz at the port the config serves,
  the region from the Node's label (an init step with RBAC to get nodes, whose script is
  tested here), a tracker Service other clusters can reach, image tags pinned to the version.
- systemd: `systemd-analyze verify` and `security` (exposure <= 3.0) on each unit, and the
  sysusers/tmpfiles snippets applied to a scratch root (skipped with the reason where
  systemd's tools are absent and cannot be installed).
- Compose: a tracker, an origin and three nodes, each from its credentials, healthy-gated.
- Docker: base and packages pinned, a HEALTHCHECK on /healthz, a non-root user.
Every command line any of them runs parses with the real CLI, its config file and
environment layered as the service would (flag > env > file > default).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from patchswarm.node.cli import build_parser, parse
from patchswarm.node.net import config

from aptinstall import ensure_command

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"patchswarm:{VERSION}"
SERVICES = ("tracker", "origin", "node")


def manifests() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def objects(kind: str) -> list[dict]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def pod_specs() -> list[tuple[str, dict]]:
    return [(doc["metadata"]["name"], doc["spec"]["template"]["spec"])
            for _, doc in manifests() if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def configmap(name: str) -> dict[str, str]:
    (cm,) = [doc for doc in objects("ConfigMap") if doc["metadata"]["name"] == name]
    return cm["data"]


def region_script() -> dict:
    """The node's region init step, from its ConfigMap, loaded as a module (not run)."""
    namespace = {"__name__": "region"}
    exec(compile(configmap("patchswarm-node")["region.py"], "region.py", "exec"), namespace)
    return namespace


# ------------------------------------------------------------------ every command line parses


def _layered(argv: list[str], env: dict[str, str], files: dict[str, Path]):
    """The service's settings as it would resolve them, its config path mapped to the file in the repo."""
    argv = [str(files.get(a, a)) for a in argv]
    missing = [a for a in argv if a.startswith("/etc/patchswarm/") or a.startswith("/run/patchswarm/config")]
    assert not missing, f"config files not in the repository: {missing}"
    return parse(argv, environ={k: v for k, v in env.items() if k.startswith("PATCHSWARM_")})


def systemd_commands():
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        (line,) = re.findall(r"^ExecStart=(.+)$", unit.read_text(), re.M)
        argv = shlex.split(line)
        assert argv[0] == "/opt/patchswarm/.venv/bin/patchswarm", unit
        yield unit.name, argv[1:], {}


def kubernetes_commands(tmp: Path):
    files = {}
    for cm in objects("ConfigMap"):
        for key, text in cm["data"].items():
            if key.endswith(".toml"):
                path = tmp / f"{cm['metadata']['name']}-{key}"
                if key == "node.toml":  # as the region init step writes it
                    text = region_script()["with_region"](text, "us-east-1")
                path.write_text(text)
                files[f"/etc/patchswarm/{key}"] = files[f"/run/patchswarm/config/{key}"] = path
    for name, spec in pod_specs():
        for c in spec["containers"]:
            env = {e["name"]: re.sub(r"\$\((\w+)\)", "10.0.0.7", e.get("value", "x")) for e in c.get("env", [])}
            yield f"{name}/{c['name']}", c["args"], env, files


def compose_commands():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    files = {f"/etc/patchswarm/{s}.toml": DEPLOY / "config" / f"{s}.toml" for s in SERVICES}
    for name, svc in compose["services"].items():
        if name != "credentials":
            yield name, svc["command"], {k: str(v) for k, v in svc.get("environment", {}).items()}, files


def test_every_service_command_line_resolves(tmp_path):
    seen = []
    lines = [(w, a, e, {f"/etc/patchswarm/{s}.toml": DEPLOY / "config" / f"{s}.toml" for s in SERVICES})
             for w, a, e in systemd_commands()]
    lines += list(kubernetes_commands(tmp_path)) + list(compose_commands())
    for where, argv, env, files in lines:
        args = _layered(argv, env, files)
        assert args.command in SERVICES, where
        if args.command != "tracker":
            assert args.region and args.region != "default", where
        seen.append(args.command)
    assert sorted(set(seen)) == sorted(SERVICES)


@pytest.mark.parametrize("path", sorted((DEPLOY / "config").glob("*.toml")), ids=lambda p: p.name)
def test_config_files_check_clean(path):
    service = config.file_service(path)
    assert service in SERVICES
    assert config.check_file(build_parser().subcommands[service], service, path) == []


def test_configmap_configs_check_clean(tmp_path):
    for cm in objects("ConfigMap"):
        for key, text in cm["data"].items():
            if key.endswith(".toml"):
                path = tmp_path / key
                path.write_text(text)
                service = config.file_service(path)
                assert config.check_file(build_parser().subcommands[service], service, path) == [], key


# ------------------------------------------------------------------ Kubernetes


def test_kubernetes_validate_strict_passes_every_manifest():
    tool = Path(sys.executable).parent / "kubernetes-validate"
    files = sorted(str(p) for p in (DEPLOY / "kubernetes").glob("*.yaml"))
    r = subprocess.run([str(tool), "--strict", *files], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") == len(manifests())


def test_kubernetes_validate_strict_can_fail(tmp_path):
    """The check above is a real one: an unknown field in a pod spec is refused."""
    bad = tmp_path / "bad.yaml"
    text = (DEPLOY / "kubernetes" / "tracker.yaml").read_text()
    bad.write_text(text.replace("automountServiceAccountToken: false", "automountServiceAccountToken: false\n"
                                                                       "      hostNetwrk: true"))
    tool = Path(sys.executable).parent / "kubernetes-validate"
    r = subprocess.run([str(tool), "--strict", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "hostNetwrk" in r.stdout + r.stderr


def test_everything_is_in_the_patchswarm_namespace():
    assert [n["metadata"]["name"] for n in objects("Namespace")] == ["patchswarm"]
    for where, doc in manifests():
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"].get("namespace") == "patchswarm", (where, doc["kind"], doc["metadata"]["name"])


def _containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def test_pods_run_as_non_root_with_fs_group_and_locked_down_containers():
    for name, spec in pod_specs():
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["fsGroup"] == sc["runAsGroup"], name
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", name
        for c in _containers(spec):
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False and csc["readOnlyRootFilesystem"] is True, c["name"]
            assert csc["capabilities"]["drop"] == ["ALL"], c["name"]
            root = csc.get("runAsUser") == 0
            # Only an init step runs as root, and only with the capabilities to own files.
            assert not root or (c in spec.get("initContainers", []) and set(csc["capabilities"]["add"]) <= {"CHOWN", "FOWNER"})
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], c["name"]


def test_secrets_are_readable_by_the_service_through_fs_group():
    for name, spec in pod_specs():
        for v in spec["volumes"]:
            if "secret" in v:
                mode = v["secret"]["defaultMode"]
                assert mode & 0o040 and not mode & 0o007, (name, oct(mode))  # group-readable, others nothing
                assert spec["securityContext"]["fsGroup"], name


def test_host_network_pods_resolve_cluster_names():
    for name, spec in pod_specs():
        if spec.get("hostNetwork"):
            assert spec["dnsPolicy"] == "ClusterFirstWithHostNet", name


def test_host_path_data_dir_is_given_to_the_service_user_by_an_init_step():
    for name, spec in pod_specs():
        host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                if m["name"] in host and not m.get("readOnly"):
                    owners = [i for i in spec.get("initContainers", [])
                              if any(x["name"] == m["name"] for x in i.get("volumeMounts", []))
                              and f"chown {spec['securityContext']['runAsUser']}:" in " ".join(i["args"])
                              and m["mountPath"] in " ".join(i["args"])]
                    assert owners, (name, m["name"])


def test_node_daemonset_tolerates_gpu_hosts_and_takes_the_region_from_the_node_label():
    (ds,) = objects("DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    text = yaml.safe_dump(ds)
    assert "metadata.labels['topology.kubernetes.io/region']" not in text  # a pod label: empty without a plugin
    (step,) = [c for c in spec["initContainers"] if c["name"] == "region"]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in step["env"]
    # Its token: a projected service account token mounted in the init step alone.
    assert spec["automountServiceAccountToken"] is False
    token_volumes = {v["name"] for v in spec["volumes"] if "projected" in v
                     and any("serviceAccountToken" in s for s in v["projected"]["sources"])}
    assert token_volumes and all(not any(m["name"] in token_volumes for m in c.get("volumeMounts", []))
                                 for c in spec["containers"])
    account = spec["serviceAccountName"]
    (binding,) = [b for b in objects("ClusterRoleBinding")
                  if {"kind": "ServiceAccount", "name": account, "namespace": "patchswarm"} in b["subjects"]]
    (role,) = [r for r in objects("ClusterRole") if r["metadata"]["name"] == binding["roleRef"]["name"]]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]  # nothing more


def test_region_step_script(tmp_path):
    script = region_script()
    node = {"metadata": {"name": "gpu-7", "labels": {"topology.kubernetes.io/region": "eu-west-4"}}}
    assert script["region_of"](node) == "eu-west-4"
    with pytest.raises(SystemExit, match="no topology.kubernetes.io/region label.*kubectl label node gpu-7"):
        script["region_of"]({"metadata": {"name": "gpu-7", "labels": {}}})
    base = configmap("patchswarm-node")["node.toml"]
    assert "region" not in tomllib.loads(base)
    out = tmp_path / "node.toml"
    out.write_text(script["with_region"](base, 'eu-"west"'))
    assert tomllib.loads(out.read_text())["region"] == 'eu-"west"'


def _http_port(container: dict, port_name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port_name)


def test_probes_hit_healthz_and_readyz_where_the_service_serves_them():
    for name, spec in pod_specs():
        for c in spec["containers"]:
            probes = {k: c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
            assert probes["livenessProbe"]["path"] == "/healthz" and probes["readinessProbe"]["path"] == "/readyz"
            served = {_http_port(c, p["port"]) if isinstance(p["port"], str) else p["port"]
                      for p in probes.values()}
            cm_name = next(v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v)
            toml = next(t for k, t in configmap(cm_name).items() if k.endswith(".toml"))
            assert served == {int(tomllib.loads(toml)["metrics"].rpartition(":")[2])}, name


def test_tracker_is_reachable_from_other_clusters_and_its_page_only_inside():
    services = {s["metadata"]["name"]: s["spec"] for s in objects("Service")}
    swarm = services["patchswarm-tracker"]
    assert swarm["type"] == "LoadBalancer" and [p["port"] for p in swarm["ports"]] == [7700]
    assert services["patchswarm-tracker-http"]["type"] == "ClusterIP"
    node_cm = tomllib.loads(configmap("patchswarm-node")["node.toml"])
    assert node_cm["tracker"].startswith("patchswarm-tracker.patchswarm.svc")


def test_images_are_pinned_to_the_package_version():
    for name, spec in pod_specs():
        for c in _containers(spec):
            assert c["image"] == IMAGE, (name, c["name"], c["image"])
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert {s["image"] for s in compose["services"].values()} == {IMAGE}


# ------------------------------------------------------------------ systemd


def _systemd_tools() -> str:
    return ensure_command("systemd-analyze", "systemd")


UNITS = sorted(p.name for p in (DEPLOY / "systemd").glob("*.service"))


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_security_exposure_at_most_3(unit):
    tool = _systemd_tools()
    r = subprocess.run([tool, "security", "--offline=yes", "--threshold=30", str(DEPLOY / "systemd" / unit)],
                       capture_output=True, text=True, timeout=120)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    assert float(m.group(1)) <= 3.0 and r.returncode == 0, r.stdout[-3000:]


def test_systemd_units_verify(tmp_path):
    """`systemd-analyze verify` in a scratch root: the system's unit tree, the units, and an executable
    where each Exec line points (verify checks it exists); any warning fails."""
    tool = _systemd_tools()
    root = tmp_path / "root"
    shutil.copytree(Path("/usr/lib/systemd/system"), root / "usr/lib/systemd/system", symlinks=True)
    for unit in UNITS:
        for path in re.findall(r"^Exec\w+=(/\S+)", (DEPLOY / "systemd" / unit).read_text(), re.M):
            exe = root / path.lstrip("/")
            exe.parent.mkdir(parents=True, exist_ok=True)
            exe.write_text("#!/bin/sh\nexit 0\n")
            exe.chmod(0o755)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(DEPLOY / "systemd" / unit, units / unit)
    r = subprocess.run([tool, "verify", f"--root={root}", *UNITS], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


def test_systemd_units_are_notify_services_as_patchswarm():
    for unit in UNITS:
        text = (DEPLOY / "systemd" / unit).read_text()
        for line in ("Type=notify", "User=patchswarm", "Group=patchswarm", "NoNewPrivileges=yes",
                     "ProtectSystem=strict", "CapabilityBoundingSet=\n"):
            assert line in text, (unit, line)
        (cmd,) = re.findall(r"^ExecStart=\S+ (\w+) --config /etc/patchswarm/(\w+)\.toml$", text, re.M)
        assert cmd[0] == cmd[1] and unit == f"patchswarm-{cmd[0]}.service"


def test_sysusers_and_tmpfiles_make_the_user_and_the_permissions(tmp_path):
    _systemd_tools()
    sysusers, tmpfiles = shutil.which("systemd-sysusers"), shutil.which("systemd-tmpfiles")
    if not sysusers or not tmpfiles:
        pytest.skip("systemd-sysusers or systemd-tmpfiles is not installed")
    root = tmp_path / "root"
    (root / "etc/patchswarm/creds").mkdir(parents=True)
    for f in ("etc/passwd", "etc/group", "etc/patchswarm/creds/gpu-1.key", "etc/patchswarm/trainer.key"):
        (root / f).write_text("")
    (root / "etc/patchswarm/creds/gpu-1.key").chmod(0o600)
    r = subprocess.run([sysusers, f"--root={root}", str(DEPLOY / "systemd/patchswarm.sysusers.conf")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    group = next(line for line in (root / "etc/group").read_text().splitlines() if line.startswith("patchswarm:"))
    gid = int(group.split(":")[2])
    user = next(line for line in (root / "etc/passwd").read_text().splitlines() if line.startswith("patchswarm:"))
    assert user.split(":")[6] == "/usr/sbin/nologin"
    r = subprocess.run([tmpfiles, f"--root={root}", "--create", str(DEPLOY / "systemd/patchswarm.tmpfiles.conf")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for path, mode, owned_by_user in [("etc/patchswarm", 0o750, False), ("etc/patchswarm/creds", 0o750, False),
                                      ("etc/patchswarm/creds/gpu-1.key", 0o640, False),
                                      ("etc/patchswarm/trainer.key", 0o640, False),
                                      ("var/lib/patchswarm", 0o750, True), ("var/lib/patchswarm-origin", 0o750, True)]:
        st = (root / path).stat()
        assert (st.st_mode & 0o7777, st.st_gid) == (mode, gid), path
        assert (st.st_uid != 0) == owned_by_user, path


# ------------------------------------------------------------------ compose and Docker


def test_compose_brings_up_a_tracker_an_origin_and_three_nodes():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert sorted(services) == ["credentials", "node-1", "node-2", "node-3", "origin", "tracker"]
    script = services["credentials"]["command"][0]
    issued = {name: (role, region or None) for name, role, region in
              re.findall(r"swarm issue /swarm/swarm (\S+) --role (\w+)(?: --region (\S+))? -o /swarm/creds/\1",
                         script.replace("$$n", "NODE"))}
    loop = re.search(r"for n in ([\w\- ]+); do", script).group(1).split()
    issued.update({n: issued["NODE"] for n in loop})
    issued.pop("NODE")
    regions = set()
    for name, svc in services.items():
        if name == "credentials":
            continue
        env = svc["environment"]
        role = svc["command"][0]
        cert_role, cert_region = issued[env["PATCHSWARM_CREDS"].rsplit("/", 1)[1]]
        assert cert_role == role, name
        # Each member's certificate is good for its region only (node/net/trust.py): the region it runs in.
        assert cert_region == env.get("PATCHSWARM_REGION"), name
        assert env["PATCHSWARM_METRICS"] == "0.0.0.0:9400", name  # where the image's HEALTHCHECK looks
        assert svc["depends_on"]["credentials"]["condition"] == "service_completed_successfully"
        if name != "tracker":
            assert svc["depends_on"]["tracker"]["condition"] == "service_healthy"
            regions.add(env["PATCHSWARM_REGION"])
    assert len(regions) == 2  # two regions: same-region and cross-region paths both run
    for s in services.values():
        for v in s.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("./"):
                assert (DEPLOY / src).exists(), src


DOCKERFILE = (DEPLOY / "Dockerfile").read_text()


def test_dockerfile_copies_what_exists():
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path


def test_dockerfile_pins_base_packages_and_checks_health():
    (base,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE, re.M)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base), base
    assert all(f in ("${PYTHON_IMAGE}", "${PYTHON_IMAGE} AS build") for f in re.findall(r"^FROM (.+)$", DOCKERFILE, re.M))
    for install in re.findall(r"apt-get install ([^&]+)", DOCKERFILE.replace("\\\n", " ")):
        packages = [w for w in shlex.split(install) if not w.startswith("-")]
        assert "--no-install-recommends" in install and packages
        assert all("=" in p for p in packages), packages
    for pip in re.findall(r"pip (?:install|wheel) ([^&]+)", DOCKERFILE.replace("\\\n", " ")):
        assert "-c " in pip or "--no-deps" in pip, pip
    assert re.search(r"^HEALTHCHECK .*\n?.*/healthz", DOCKERFILE, re.M)
    (user,) = re.findall(r"^USER (\S+)$", DOCKERFILE, re.M)
    assert user.split(":")[0] not in ("0", "root")


def test_lock_pins_every_runtime_dependency():
    lock = dict(line.split("==") for line in (DEPLOY / "requirements.lock").read_text().splitlines()
                if line and not line.startswith("#"))
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0]).lower()
        assert name in lock, name
    assert all(re.fullmatch(r"[\w.]+", v) for v in lock.values())
