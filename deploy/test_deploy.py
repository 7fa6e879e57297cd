"""The deployment files, checked as an operator's tools would and then run.

- Every file in deploy/kubernetes/ but kustomization.yaml is one complete
  resource that kubernetes-validate --strict accepts (cert-manager's kinds,
  which it has no schema for, are held to the fields their v1 API has);
  checkov finds nothing beyond the exceptions listed below, with reasons.
- The pod's and the Job's container command lines run here as local
  processes, with each volume a temporary directory: qemu-nbd (the native
  sidecar), nbdgw (its args and env names as the manifest has them), the
  probes, then the backup Job's nbdcopy through nbdgw, whose copy must equal
  the disk; then SIGTERM drains nbdgw as the kubelet would.
- Least privilege: the backup identity can only read, through the
  manifest's policy (checked as written, then by nbdgw itself in front of
  a writable qemu-nbd); the systemd unit's group that reads the TLS key is
  not the group the NBD server's socket is shared with.
- The Containerfile builds with the same script and binary path as the
  demo (scripts/build-release.sh).

Run by scripts/test.sh with the tools' virtualenv (scripts/setup.sh), after
cargo test built target/debug/nbdgw.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import tomllib
import unittest
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "kubernetes"
# Client mode's example (README "Client mode > Kubernetes"): a kustomization
# of its own, applied after the base.
CLIENT_MODE = K8S / "client-mode"
# The node gateway replaced under its sessions (docs/guides/restarts.md,
# "Kubernetes"): a kustomization of its own, applied after the base.
NODE_GATEWAY = K8S / "node-gateway"
SYSTEMD = REPO / "deploy" / "systemd"
CONTAINER = REPO / "deploy" / "container"
NBDGW = REPO / "target" / "debug" / "nbdgw"

# checkov findings left open, each with its reason.
CHECKOV_EXCEPTIONS = {
    # The images are built by the operator from deploy/container/, so
    # their digests exist only after that build; pin them with kustomize
    # (`images: - name: … digest: sha256:…`) once pushed.
    "CKV_K8S_43": "images are pinned by version tag; digests exist only after the operator builds them",
}

# The cert-manager v1 fields these manifests use, per kind: kubernetes-validate
# bundles no CRD schemas, so a misspelt field would otherwise pass unseen.
CERT_MANAGER_FIELDS = {
    "Issuer": {"spec": {"ca": {"secretName": None}}},
    "Certificate": {
        "spec": {
            "secretName": None,
            "duration": None,
            "renewBefore": None,
            "privateKey": {"algorithm": None, "size": None, "rotationPolicy": None},
            "usages": None,
            "dnsNames": None,
            "commonName": None,
            "uris": None,
            "issuerRef": {"kind": None, "name": None},
        }
    },
}


def tool(name):
    """A tool from the deployment virtualenv, else from PATH."""
    venv = Path(os.environ.get("NBDGW_DEPLOY_VENV", ""), "bin", name)
    return str(venv) if venv.exists() else name


def resource_files(directory=K8S):
    return sorted(p for p in directory.glob("*.yaml") if p.name != "kustomization.yaml")


def load(name, directory=K8S):
    docs = [d for d in yaml.safe_load_all((directory / name).read_text()) if d]
    assert len(docs) == 1, f"{name}: one resource per file, found {len(docs)}"
    return docs[0]


def unknown_fields(doc, allowed, where=""):
    found = []
    for key, value in doc.items():
        if key not in allowed:
            found.append(f"{where}{key}")
        elif isinstance(allowed[key], dict):
            found += unknown_fields(value, allowed[key], f"{where}{key}.")
    return found


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


class Manifests(unittest.TestCase):
    def test_every_resource_file_validates_strictly(self):
        for path in resource_files() + resource_files(CLIENT_MODE) + resource_files(NODE_GATEWAY):
            doc = load(path.name, path.parent)
            out = subprocess.run(
                [tool("kubernetes-validate"), "--strict", str(path)],
                capture_output=True, text=True, timeout=120,
            )
            said = out.stdout + out.stderr
            self.assertEqual(out.returncode, 0, f"{path.name}: {said}")
            if doc["apiVersion"] == "cert-manager.io/v1":
                self.assertIn("Couldn't find schema", said)
                allowed = {"apiVersion": None, "kind": None, "metadata": None}
                allowed.update(CERT_MANAGER_FIELDS[doc["kind"]])
                self.assertEqual(unknown_fields(doc, allowed), [], path.name)
            else:
                self.assertIn("passed", said, path.name)

    def test_the_kustomization_lists_every_file(self):
        for directory in (K8S, CLIENT_MODE, NODE_GATEWAY):
            kustomization = load("kustomization.yaml", directory)
            self.assertEqual(
                sorted(kustomization["resources"]), [p.name for p in resource_files(directory)]
            )
            self.assertEqual(kustomization["namespace"], "disks")

    def test_checkov_finds_nothing_but_the_listed_exceptions(self):
        out = subprocess.run(
            # -d is recursive: client-mode/ is linted too.
            [tool("checkov"), "-d", str(K8S), "--framework", "kubernetes",
             "--output", "json", "--compact",
             "--skip-check", ",".join(CHECKOV_EXCEPTIONS)],
            capture_output=True, text=True, timeout=600,
        )
        report = json.loads(out.stdout)
        reports = report if isinstance(report, list) else [report]
        failed = [
            f"{c['check_id']} {c['resource']} {c['file_path']}"
            for r in reports for c in r.get("results", {}).get("failed_checks", [])
        ]
        self.assertEqual(failed, [])
        passed = sum(r.get("summary", {}).get("passed", 0) for r in reports)
        self.assertGreater(passed, 100, out.stdout[:2000])
        linted = {c["file_path"] for r in reports for c in r.get("results", {}).get("passed_checks", [])}
        self.assertIn("/client-mode/backup-via-client-job.yaml", linted)
        self.assertIn("/node-gateway/daemonset.yaml", linted)

    def test_every_environment_variable_is_one_nbdgw_reads(self):
        help_text = subprocess.run([str(NBDGW), "--help"], capture_output=True, text=True).stdout
        known = {word.split("=")[0] for word in help_text.split("[env: ")[1:]}
        self.assertIn("NBDGW_ALLOW_URI", known)
        nbdgw, = load("deployment.yaml")["spec"]["template"]["spec"]["containers"]
        for var in nbdgw.get("env", []):
            self.assertIn(var["name"], known)

    def test_the_pod_follows_the_pitfalls_found_in_practice(self):
        pod = load("deployment.yaml")["spec"]["template"]["spec"]
        sidecar, = pod["initContainers"]
        nbdgw, = pod["containers"]
        # The test overlay's JSON patch moves initContainers/0 by index:
        # it must be qemu-nbd, the only one.
        self.assertEqual(sidecar["name"], "qemu-nbd")
        # qemu-nbd starts first and stops last.
        self.assertEqual(sidecar["restartPolicy"], "Always")
        # One user for both, so nbdgw may connect to qemu-nbd's socket.
        context = pod["securityContext"]
        for key in ("runAsUser", "runAsGroup", "fsGroup"):
            self.assertIn(key, context)
        self.assertTrue(context["runAsNonRoot"])
        self.assertEqual(context["seccompProfile"]["type"], "RuntimeDefault")
        for container in (sidecar, nbdgw):
            self.assertNotIn("runAsUser", container.get("securityContext", {}))
            self.assertEqual(container["securityContext"]["capabilities"]["drop"], ["ALL"])
            self.assertTrue(container["securityContext"]["readOnlyRootFilesystem"])
            self.assertFalse(container["securityContext"]["allowPrivilegeEscalation"])
            image = container["image"]
            self.assertRegex(image, r":[\w.-]+$")
            self.assertFalse(image.endswith(":latest"), image)
        flags = dict(a.removeprefix("--").split("=", 1) for a in nbdgw["args"])
        self.assertEqual(flags["listen"], "[::]:10809")
        self.assertGreater(
            pod["terminationGracePeriodSeconds"],
            int(flags["drain-delay"]) + int(flags["shutdown-grace"]),
        )
        self.assertEqual(int(flags["threads"]), int(nbdgw["resources"]["limits"]["cpu"]))
        self.assertEqual(nbdgw["readinessProbe"]["httpGet"]["path"], "/readyz")
        self.assertEqual(nbdgw["livenessProbe"]["httpGet"]["path"], "/healthz")
        annotations = load("deployment.yaml")["spec"]["template"]["metadata"]["annotations"]
        self.assertEqual(annotations["prometheus.io/port"], flags["admin-listen"].rsplit(":", 1)[1])

    def test_the_podman_overlay_renders_the_pod_container_test_expects(self):
        rendered = subprocess.run([tool("kubectl"), "kustomize", str(REPO / "deploy" / "kubernetes-test-podman")],
                                  capture_output=True, text=True, timeout=60)
        self.assertEqual(rendered.returncode, 0, rendered.stderr)
        deployment, = [d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "Deployment"]
        template = deployment["spec"]["template"]
        self.assertEqual(template["metadata"]["labels"]["nbdgw-test"], "overlay")
        pod = template["spec"]
        self.assertNotIn("initContainers", pod)
        self.assertEqual([c["name"] for c in pod["containers"]], ["qemu-nbd", "nbdgw"])
        self.assertNotIn("restartPolicy", pod["containers"][0])
        ports = {p["name"]: p["hostPort"] for p in pod["containers"][1]["ports"]}
        script = (REPO / "scripts" / "container-run.sh").read_text()
        self.assertIn(f"pod_nbd_port={ports['nbd']}\n", script)
        self.assertIn(f"pod_admin_port={ports['admin']}\n", script)

    def test_the_node_gateway_renders_a_daemonset_that_can_hand_over(self):
        """kubectl kustomize renders node-gateway/; the DaemonSet has what a
        hand-over between its old and new pod needs (restarts.md)."""
        rendered = subprocess.run([tool("kubectl"), "kustomize", str(NODE_GATEWAY)],
                                  capture_output=True, text=True, timeout=60)
        self.assertEqual(rendered.returncode, 0, rendered.stderr)
        daemonset, = [d for d in yaml.safe_load_all(rendered.stdout) if d]
        self.assertEqual(daemonset["kind"], "DaemonSet")
        self.assertEqual(daemonset["metadata"]["namespace"], "disks")
        spec = daemonset["spec"]
        # The new pod starts beside the old one, which goes only once the
        # new one is available.
        self.assertEqual(spec["updateStrategy"]["type"], "RollingUpdate")
        self.assertEqual(spec["updateStrategy"]["rollingUpdate"], {"maxSurge": 1, "maxUnavailable": 0})
        self.assertGreater(spec["minReadySeconds"], 0)
        pod = spec["template"]["spec"]
        self.assertTrue(pod["hostNetwork"])
        nbdgw, = pod["containers"]
        # On the host network a declared port is a hostPort: the surge pod
        # could not be placed beside the old one.
        for container in pod["containers"] + pod["initContainers"]:
            self.assertNotIn("ports", container)
        flags = dict(a.removeprefix("--").split("=", 1) for a in nbdgw["args"])
        self.assertEqual(flags["take-over"], flags["handover-socket"])
        self.assertEqual(flags["take-over-missing"], "start")
        self.assertEqual(flags["after-handover"], "wait")
        help_text = subprocess.run([str(NBDGW), "--help"], capture_output=True, text=True).stdout
        for flag in flags:
            self.assertIn(f"--{flag}", help_text)
        # The hand-over socket's directory: one hostPath both pods mount,
        # made 65532's 0700 first; the upstream sockets too, on the node.
        mounts = {m["mountPath"]: m["name"] for m in nbdgw["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        handover_dir = flags["handover-socket"].rsplit("/", 1)[0]
        self.assertIn("hostPath", volumes[mounts[handover_dir]])
        upstream_dir = flags["upstream"].rsplit("/", 1)[0]
        self.assertIn("hostPath", volumes[mounts[upstream_dir]])
        init, = pod["initContainers"]
        self.assertEqual(init["command"], ["install", "-d", "-o", "65532", "-g", "65532", "-m", "0700", handover_dir])
        self.assertEqual(init["volumeMounts"][0]["mountPath"], handover_dir)
        self.assertEqual(pod["securityContext"]["runAsUser"], 65532)
        # Readiness on the admin port, by number (no port is declared);
        # no liveness probe: on the shared port it would judge the other
        # pod's gateway and could restart the idle old one.
        admin_port = int(flags["admin-listen"].rsplit(":", 1)[1])
        self.assertEqual(nbdgw["readinessProbe"]["httpGet"], {"path": "/readyz", "port": admin_port})
        self.assertGreater(nbdgw["readinessProbe"]["initialDelaySeconds"], 0)
        self.assertNotIn("livenessProbe", nbdgw)
        self.assertGreater(pod["terminationGracePeriodSeconds"], int(flags["shutdown-grace"]))
        for container in pod["containers"] + pod["initContainers"]:
            self.assertEqual(container["securityContext"]["capabilities"]["drop"], ["ALL"])
            self.assertTrue(container["securityContext"]["readOnlyRootFilesystem"])
            self.assertFalse(container["securityContext"]["allowPrivilegeEscalation"])
        # The base's Secret and ConfigMap, by name.
        base_pod = load("deployment.yaml")["spec"]["template"]["spec"]
        base_volumes = {v["name"]: v for v in base_pod["volumes"]}
        self.assertEqual(volumes["tls"], base_volumes["tls"])
        self.assertEqual(volumes["policy"], base_volumes["policy"])

    def test_client_modes_job_follows_the_same_pitfalls(self):
        job = load("backup-via-client-job.yaml", CLIENT_MODE)
        pod = job["spec"]["template"]["spec"]
        sidecar, = pod["initContainers"]
        nbdcopy, = pod["containers"]
        # nbdgw client starts first, once its socket is bound, and stops last.
        self.assertEqual(sidecar["restartPolicy"], "Always")
        self.assertEqual(sidecar["startupProbe"]["httpGet"]["path"], "/healthz")
        self.assertEqual(sidecar["args"][0], "client")
        # Dual-stack like the base's: 0.0.0.0 never starts on an IPv6
        # single-stack cluster, so the startupProbe would never pass.
        self.assertIn("--admin-listen=[::]:9090", sidecar["args"])
        # Not the file backup-job.yaml writes on the same claim.
        plain = load("backup-job.yaml")["spec"]["template"]["spec"]["containers"][0]["command"]
        self.assertNotEqual(nbdcopy["command"][-1], plain[-1])
        for key in ("runAsUser", "runAsGroup", "fsGroup"):
            self.assertIn(key, pod["securityContext"])
        for container in (sidecar, nbdcopy):
            self.assertEqual(container["securityContext"]["capabilities"]["drop"], ["ALL"])
            self.assertTrue(container["securityContext"]["readOnlyRootFilesystem"])
        # The base's server, identity, PVC and NetworkPolicy, by name.
        flags = dict(a.removeprefix("--").split("=", 1) for a in sidecar["args"] if "=" in a)
        service = load("service.yaml")
        self.assertEqual(flags["server"], f"{service['metadata']['name']}.disks.svc:{service['spec']['ports'][0]['port']}")
        self.assertIn(flags["server"].split(":")[0], load("certificate.yaml")["spec"]["dnsNames"])
        secret = next(v for v in pod["volumes"] if v["name"] == "client-tls")["secret"]
        self.assertEqual(secret["secretName"], load("backup-client-certificate.yaml")["spec"]["secretName"])
        self.assertNotIn("items", secret)  # nbdgw client reads the Kubernetes layout
        labels = job["spec"]["template"]["metadata"]["labels"]
        selector = load("networkpolicy-disk-backup.yaml")["spec"]["podSelector"]["matchLabels"]
        self.assertEqual(labels, selector)


class Containerfile(unittest.TestCase):
    def test_the_image_builds_with_the_demo_script_and_ships_its_binary(self):
        text = (CONTAINER / "Containerfile").read_text()
        lines = [l.strip() for l in text.splitlines() if l.strip() and not l.startswith("#")]
        runs = [l for l in lines if l.startswith("RUN ")]
        self.assertEqual(runs, ["RUN scripts/build-release.sh --strip"])
        script = (REPO / "scripts" / "build-release.sh").read_text()
        self.assertIn("cargo build --release --locked", script)
        built = script.strip().splitlines()[-1]
        self.assertEqual(built, "echo target/release/nbdgw")
        self.assertIn("scripts/build-release.sh", (REPO / "scripts" / "demo.sh").read_text())
        self.assertIn("WORKDIR /src", lines)
        self.assertIn("COPY --from=build /src/target/release/nbdgw /usr/local/bin/nbdgw", lines)
        self.assertIn('ENTRYPOINT ["nbdgw"]', lines)
        user = next(l for l in lines if l.startswith("USER "))
        self.assertRegex(user, r"^USER \d+:\d+$")
        for base in (l.split()[1] for l in lines if l.startswith("FROM ")):
            self.assertRegex(base, r":[\w.-]+$")
            self.assertNotIn(":latest", base)
        self.assertIn("target", (REPO / ".containerignore").read_text().split())


class ContainerScripts(unittest.TestCase):
    """scripts/container-*.sh's failure paths, with a fake apt-get: a base
    whose making fails must stop the run and must not be cached."""

    def run_bases(self, body, apt_get):
        scratch = Path(tempfile.mkdtemp(prefix="nbdgw-bases-"))
        self.addCleanup(shutil.rmtree, scratch)
        (scratch / "bin").mkdir()
        fake = scratch / "bin" / "apt-get"
        fake.write_text("#!/bin/sh\n" + apt_get)
        fake.chmod(0o755)
        (scratch / "cache").mkdir()
        (scratch / "work").mkdir()
        # The shell options exactly as container-test.sh sets them.
        header = (REPO / "scripts" / "container-test.sh").read_text().split("\ncd ")[0]
        script = header + f"""
cache={scratch}/cache work={scratch}/work
log() {{ :; }}
fail() {{ echo "FAILED: $*" >&2; exit 1; }}
source {REPO}/scripts/container-bases.sh
{body}
echo reached
"""
        env = dict(os.environ, PATH=f"{scratch / 'bin'}:{os.environ['PATH']}")
        done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
        return done, sorted(p.name for p in (scratch / "cache").iterdir())

    def test_a_failed_download_stops_the_run_and_caches_no_runtime_base(self):
        # A fake apt-get (a mirror that 404s): the lists and the URIs
        # answer, the download fails.
        apt_get = """case "$*" in
  *--print-uris*) echo "'http://mirror/libc6.deb' libc6.deb 1 SHA256:00" ;;
  update*) ;;
  *) echo "E: 404 Not Found" >&2; exit 100 ;;
esac
"""
        done, cached = self.run_bases("main() { runtime=$(runtime_image); }; main", apt_get)
        self.assertNotIn("reached", done.stdout, done.stderr)
        self.assertNotEqual(done.returncode, 0)
        self.assertEqual(cached, [], done.stderr)


class Pod:
    """The manifests' containers as local processes; each volume a directory."""

    def __init__(self, scratch, nbd_port=None):
        self.scratch = scratch
        self.nbd_port, self.admin_port = nbd_port or free_port(), free_port()
        self.processes = []

    def volume_dir(self, name):
        path = self.scratch / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def translate(self, container, volumes):
        """argv and environment for one container, paths and ports local."""
        if "command" in container:
            argv = list(container["command"]) + list(container.get("args", []))
        else:  # the nbdgw image's ENTRYPOINT
            argv = [str(NBDGW)] + list(container["args"])
        mounts = {m["mountPath"]: self.volume_dir(m["name"]) for m in container.get("volumeMounts", [])}
        swaps = {
            "[::]:10809": f"127.0.0.1:{self.nbd_port}",
            "[::]:9090": f"127.0.0.1:{self.admin_port}",
            "disk-export:10809": f"localhost:{self.nbd_port}",
            "disk-export.disks.svc:10809": f"localhost:{self.nbd_port}",
        }
        swaps.update({path: str(local) for path, local in mounts.items()})

        def local(word):
            for remote, here in sorted(swaps.items(), key=lambda kv: -len(kv[0])):
                word = word.replace(remote, here)
            return word

        env = dict(os.environ, RUST_LOG="info")
        for var in container.get("env", []):
            env[var["name"]] = var["value"]
        return [local(w) for w in argv], env

    def start(self, container, volumes):
        argv, env = self.translate(container, volumes)
        with open(self.scratch / f"{container['name']}.log", "w") as log:
            process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.processes.append(process)
        return process

    def stop_all(self):
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def write_secret(directory, files, items=None):
    """A Secret volume: every key as a file, or only `items`, renamed."""
    directory.mkdir(parents=True, exist_ok=True)
    for item in items or [{"key": k, "path": k} for k in files]:
        (directory / item["path"]).write_bytes(files[item["key"]].read_bytes())


def write_config_map(directory, config_map):
    """A ConfigMap volume: every data key as a file."""
    directory.mkdir(parents=True, exist_ok=True)
    for key, text in config_map["data"].items():
        (directory / key).write_text(text)


def nbd_uri_export(uri):
    """The export name in an nbds:// URI (its path without the leading /)."""
    return urllib.parse.urlsplit(uri).path.removeprefix("/")


class LeastPrivilege(unittest.TestCase):
    def test_the_policy_lets_the_backup_identity_read_one_export_and_nothing_more(self):
        policy = tomllib.loads(load("policy-configmap.yaml")["data"]["policy.toml"])
        backup_uri = load("backup-client-certificate.yaml")["spec"]["uris"][0]
        nbdcopy, = load("backup-job.yaml")["spec"]["template"]["spec"]["containers"]
        wanted = nbd_uri_export(nbdcopy["command"][1])
        pod = load("deployment.yaml")["spec"]["template"]["spec"]
        qemu_nbd, = pod["initContainers"]
        self.assertIn(f"--export-name={wanted}", qemu_nbd["command"])
        self.assertEqual(policy["rule"], [{
            "exports": [wanted],
            "allow": {"uri": [backup_uri]},
            "access": "read-only",
        }])
        # The layers below the policy are read-only too.
        self.assertIn("--read-only", qemu_nbd["command"])
        data_mount = next(m for m in qemu_nbd["volumeMounts"] if m["name"] == "data")
        self.assertTrue(data_mount["readOnly"])
        data = next(v for v in pod["volumes"] if v["name"] == "data")
        self.assertTrue(data["persistentVolumeClaim"]["readOnly"])
        # nbdgw is given the ConfigMap's file.
        nbdgw, = pod["containers"]
        flags = dict(a.removeprefix("--").split("=", 1) for a in nbdgw["args"] if "=" in a)
        mount = next(m for m in nbdgw["volumeMounts"] if m["name"] == "policy")
        self.assertEqual(flags["policy"], mount["mountPath"] + "/policy.toml")
        volume = next(v for v in pod["volumes"] if v["name"] == "policy")
        self.assertEqual(volume["configMap"]["name"], load("policy-configmap.yaml")["metadata"]["name"])

    def test_the_systemd_unit_shares_the_socket_through_a_group_that_cannot_read_the_key(self):
        unit = (SYSTEMD / "nbdgw.service").read_text()
        values = {}
        comments = []
        for line in unit.splitlines():
            if line.startswith("#"):
                comments.append(line.lstrip("# "))
            elif "=" in line:
                key, value = line.split("=", 1)
                values.setdefault(key, []).append(value)
        groups = " ".join(values["SupplementaryGroups"]).split()
        self.assertEqual(groups, ["nbdgw", "nbdgw-upstream"])
        text = " ".join(comments)
        # The key's group, and the group the NBD server is told to run as.
        self.assertIn("/etc/nbdgw/tls", text)
        self.assertIn("chgrp -R nbdgw /etc/nbdgw/tls", text)
        server_groups = [w.removeprefix("Group=").rstrip(",.;)") for w in text.split() if w.startswith("Group=")]
        self.assertEqual(server_groups, ["nbdgw-upstream"], text)
        self.assertNotIn("nbdgw", server_groups)
        self.assertIn("UMask=0007", text)
        # The socket in a directory of its own (RuntimeDirectory=nbd), which
        # is what lets Landlock's connect rule name only it.
        self.assertIn("RuntimeDirectory=nbd", text)
        self.assertIn("--upstream /run/nbd/disk.sock", values["ExecStart"][0])
        self.assertEqual(values["UMask"], ["0077"])
        self.assertEqual(values["DynamicUser"], ["yes"])
        # No capability, and nothing to gain one.
        self.assertEqual(values["CapabilityBoundingSet"], [""])
        self.assertEqual(values["NoNewPrivileges"], ["yes"])


class RunLocally(unittest.TestCase):
    def setUp(self):
        self.assertTrue(NBDGW.exists(), "build nbdgw first (cargo test builds target/debug/nbdgw)")
        self.scratch = scratch = Path(tempfile.mkdtemp(prefix="nbdgw-deploy-"))
        self.pod = pod = Pod(scratch)
        self.addCleanup(shutil.rmtree, scratch, ignore_errors=True)
        self.addCleanup(pod.stop_all)
        self.deployment = load("deployment.yaml")["spec"]["template"]["spec"]
        self.job = load("backup-job.yaml")["spec"]["template"]["spec"]
        client_cert = load("backup-client-certificate.yaml")["spec"]

        self.pki = pki = scratch / "pki"
        subprocess.run(
            [str(NBDGW), "certs", "--out", str(pki), "--server-name", "localhost",
             "--client-name", client_cert["commonName"], "--client-uri", client_cert["uris"][0],
             "--client-name", "intruder"],
            check=True, capture_output=True,
        )
        write_secret(pod.volume_dir("tls"), {
            "tls.crt": pki / "server-cert.pem", "tls.key": pki / "server-key.pem",
            "ca.crt": pki / "ca-cert.pem"})
        client_volume = next(v for v in self.job["volumes"] if v["name"] == "client-tls")
        write_secret(pod.volume_dir("client-tls"), {
            "tls.crt": pki / "client-cert.pem", "tls.key": pki / "client-key.pem",
            "ca.crt": pki / "ca-cert.pem"}, client_volume["secret"]["items"])
        policy_volume = next(v for v in self.deployment["volumes"] if v["name"] == "policy")
        self.assertEqual(policy_volume["configMap"]["name"], load("policy-configmap.yaml")["metadata"]["name"])
        write_config_map(pod.volume_dir("policy"), load("policy-configmap.yaml"))
        self.disk = os.urandom(4 << 20)
        (pod.volume_dir("data") / "disk.img").write_bytes(self.disk)
        self.admin = f"http://127.0.0.1:{pod.admin_port}"

    def start_pod(self, sidecar, container):
        pod = self.pod
        pod.start(sidecar, self.deployment["volumes"])
        probe, _ = pod.translate({"command": sidecar["startupProbe"]["exec"]["command"],
                                  "volumeMounts": sidecar["volumeMounts"], "name": "probe"}, [])
        self.wait_for(lambda: subprocess.run(probe).returncode == 0, "qemu-nbd's startupProbe")
        gateway = pod.start(container, self.deployment["volumes"])
        ready = container["readinessProbe"]["httpGet"]["path"]
        self.wait_for(lambda: http_status(self.admin + ready)[0] == 200, "nbdgw's readinessProbe")
        return gateway

    def backup_uri(self):
        """The Job's NBD URI, local."""
        backup, = self.job["containers"]
        argv, _ = self.pod.translate(backup, self.job["volumes"])
        return argv[1]

    def intruder_dir(self):
        intruder = self.scratch / "intruder"
        pki = self.pki
        write_secret(intruder, {
            "ca-cert.pem": pki / "ca-cert.pem", "client-cert.pem": pki / "client-intruder-cert.pem",
            "client-key.pem": pki / "client-intruder-key.pem"})
        return intruder

    def assert_backup_identity_reads_only(self):
        """The Job's identity sees a read-only export, and a copy onto it fails
        and leaves the disk as it was."""
        uri = self.backup_uri()
        info = subprocess.run(["nbdinfo", "--json", uri], capture_output=True, text=True, timeout=60)
        self.assertEqual(info.returncode, 0, info.stderr + self.log(self.scratch, "nbdgw"))
        self.assertTrue(json.loads(info.stdout)["exports"][0]["is_read_only"], info.stdout)
        junk = self.scratch / "junk.img"
        junk.write_bytes(os.urandom(len(self.disk)))
        wrote = subprocess.run(["nbdcopy", "--", str(junk), uri], capture_output=True, text=True, timeout=60)
        self.assertNotEqual(wrote.returncode, 0, wrote.stdout + wrote.stderr)
        self.assertEqual((self.pod.volume_dir("data") / "disk.img").read_bytes(), self.disk)

    def test_the_pod_and_the_backup_job_run_as_local_processes(self):
        pod, scratch, disk, admin = self.pod, self.scratch, self.disk, self.admin
        deployment, job = self.deployment, self.job
        sidecar, = deployment["initContainers"]
        container, = deployment["containers"]
        gateway = self.start_pod(sidecar, container)
        ready = container["readinessProbe"]["httpGet"]["path"]
        self.assertEqual(http_status(admin + container["livenessProbe"]["httpGet"]["path"])[0], 200)

        backup, = job["containers"]
        argv, env = pod.translate(backup, job["volumes"])
        copied = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(copied.returncode, 0, copied.stderr + self.log(scratch, "nbdgw"))
        self.assertEqual((pod.volume_dir("backups") / "disk.img").read_bytes(), disk)
        self.assert_backup_identity_reads_only()
        # The allow-list in the manifest's env is in force: another client of
        # the same CA is refused.
        intruder = self.intruder_dir()
        refused = subprocess.run(
            ["nbdinfo", "--size", f"nbds://localhost:{pod.nbd_port}/disk?tls-certificates={intruder}"],
            capture_output=True, text=True, timeout=60)
        self.assertNotEqual(refused.returncode, 0, refused.stdout)
        metrics = http_status(admin + "/metrics")[1]
        self.assertIn("nbdgw_identities_refused_total 1", metrics)
        sent = next(l for l in metrics.splitlines() if l.startswith("nbdgw_sent_bytes_total "))
        self.assertGreaterEqual(int(sent.split()[1]), len(disk), metrics)

        # The kubelet's SIGTERM: not ready at once, accepting for the drain
        # delay, then a clean exit well inside terminationGracePeriodSeconds.
        flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
        signalled = time.monotonic()
        gateway.send_signal(signal.SIGTERM)
        self.wait_for(lambda: http_status(admin + ready) == (503, "shutting down\n"), "503 after SIGTERM")
        status = gateway.wait(timeout=deployment["terminationGracePeriodSeconds"])
        self.assertEqual(status, 0, self.log(scratch, "nbdgw"))
        self.assertGreaterEqual(time.monotonic() - signalled, int(flags["drain-delay"]) - 0.5)

    def test_the_policy_alone_keeps_the_backup_identity_read_only(self):
        """nbdgw with the manifest's args and policy, but in front of a qemu-nbd
        that would take writes and without the env allow-list: what stops the
        writes is the policy."""
        sidecar, = self.deployment["initContainers"]
        sidecar = dict(sidecar, command=[a for a in sidecar["command"] if a != "--read-only"])
        container, = self.deployment["containers"]
        container = dict(container, env=[])
        self.start_pod(sidecar, container)
        log = self.log(self.scratch, "nbdgw")
        self.assertIn("landlock:", log)
        self.assert_backup_identity_reads_only()
        # Another export name, and another identity, open nothing.
        other = self.backup_uri().replace("/disk?", "/?")
        self.assertNotEqual(other, self.backup_uri())
        for uri in (other, self.backup_uri().replace(str(self.pod.volume_dir("client-tls")), str(self.intruder_dir()))):
            refused = subprocess.run(["nbdinfo", "--size", uri], capture_output=True, text=True, timeout=60)
            self.assertNotEqual(refused.returncode, 0, f"{uri}: {refused.stdout}")
        self.assertEqual((self.pod.volume_dir("data") / "disk.img").read_bytes(), self.disk)

    def test_client_modes_job_copies_the_disk_through_its_sidecar(self):
        """The base's pod as above, then client mode's Job: its nbdgw client
        sidecar with the backup identity's Secret in the Kubernetes layout,
        and nbdcopy in plaintext through the sidecar's socket."""
        sidecar, = self.deployment["initContainers"]
        container, = self.deployment["containers"]
        self.start_pod(sidecar, container)
        job = load("backup-via-client-job.yaml", CLIENT_MODE)["spec"]["template"]["spec"]
        client_pod = Pod(self.scratch / "client-job", nbd_port=self.pod.nbd_port)
        self.addCleanup(client_pod.stop_all)
        pki = self.pki
        write_secret(client_pod.volume_dir("client-tls"), {
            "tls.crt": pki / "client-cert.pem", "tls.key": pki / "client-key.pem",
            "ca.crt": pki / "ca-cert.pem"})
        client, = job["initContainers"]
        client_pod.start(client, job["volumes"])
        health = f"http://127.0.0.1:{client_pod.admin_port}" + client["startupProbe"]["httpGet"]["path"]
        self.wait_for(lambda: http_status(health)[0] == 200, "the client sidecar's startupProbe")
        nbdcopy, = job["containers"]
        argv, env = client_pod.translate(nbdcopy, job["volumes"])
        self.assertTrue(argv[1].startswith("nbd+unix:"), argv)
        copied = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        logs = self.log(self.scratch, "nbdgw") + self.log(self.scratch / "client-job", "nbdgw-client")
        self.assertEqual(copied.returncode, 0, copied.stderr + logs)
        # Its own file: backup-job.yaml writes disk.img on the same claim.
        self.assertEqual((client_pod.volume_dir("backups") / "disk-via-client.img").read_bytes(), self.disk)
        self.assertFalse((client_pod.volume_dir("backups") / "disk.img").exists())
        # The server saw the backup identity, and the sidecar stops cleanly
        # when the kubelet ends it after nbdcopy.
        self.assertIn("spiffe://cluster.local/ns/disks/sa/disk-backup", self.log(self.scratch, "nbdgw"))
        sidecar_process = client_pod.processes[0]
        sidecar_process.send_signal(signal.SIGTERM)
        self.assertEqual(sidecar_process.wait(timeout=30), 0, logs)

    def wait_for(self, condition, what, seconds=20):
        deadline = time.monotonic() + seconds
        while not condition():
            self.assertLess(time.monotonic(), deadline, f"{what} never succeeded")
            time.sleep(0.1)

    @staticmethod
    def log(scratch, name):
        return (scratch / f"{name}.log").read_text()


if __name__ == "__main__":
    unittest.main()
