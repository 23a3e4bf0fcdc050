"""``polarstream run FILE --launcher k8s --render DIR``: the run as Kubernetes manifests, one object a file.

Each component runs the command line and environment a run on one machine gives it (components.py:
``component_args``, ``child_env``; nothing here writes a component's arguments), in the project's image:
the engine a Deployment (its GPUs requested), the gateway node and the stream worker Deployments that scale
by replicas, the rollout server a Deployment, the trainer an indexed Job of ``trainer: nodes`` pods each
running torchrun (node rank = the pod's completion index; node 0's pod hosts the rendezvous, found through a
headless Service), and the driver a Job that drives them (``--driver-only``) from a copy of the experiment,
in a ConfigMap, that names their Services. Kafka and S3 are the cluster's own where POLAR_KAFKA_BOOTSTRAP /
POLAR_S3_ENDPOINT name them, else a one-broker KRaft StatefulSet and an s3proxy StatefulSet. The secrets
(S3 keys, admin token, session secret) are a Secret the pods read, never written into a pod's spec.

Every object is written for the pinned API (``API_VERSION``: the schemas kubernetes-validate checks them
against in tests/deploy/test_k8s.py). No cluster runs here: docs/deploy.md says what has not run.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import re
import secrets
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import yaml

from infra.settings import DEV_ADMIN_TOKEN, DEV_SESSION_SECRET, Settings

from .components import child_env, command_line, component_args, run_settings
from .config import RunConfig
from .experiment import Experiment, ExperimentError, KubernetesSettings

API_VERSION = "1.37.0"  # the Kubernetes API the manifests are written for (kubernetes-validate's schemas)
PORTS = {"engine": 8000, "gateway": 8100, "rollout": 8080, "ui": 8300, "streams_metrics": 9100, "trainer_metrics": 9200}
RENDEZVOUS_PORT = 29400
KAFKA_PORT, S3_PORT = 9092, 9000
RUN_DIR = Path("/polar/run")  # each pod's own (an emptyDir): nothing is shared but Kafka, S3 and HTTP
EXPERIMENT_DIR = Path("/polar/experiment")  # the driver's copy of the experiment and its task files
# What a pod reads from the Secret, not from its spec
SECRET_ENV = ("POLAR_S3_ACCESS_KEY", "POLAR_S3_SECRET_KEY", "POLAR_ADMIN_TOKEN", "POLAR_SESSION_SECRET")
CONFIGMAP_MAX = 900 << 10  # a ConfigMap holds 1 MiB at most: the task files must fit beside the experiment


def render(exp: Experiment, cfg: RunConfig, out: Path) -> Path:
    """Write the run's manifests into ``out`` (one object a file, applied in their order); returns ``out``.
    ExperimentError of one line where the run cannot be rendered as the file stands."""
    kube = exp.kubernetes or KubernetesSettings()
    if exp.model.startswith("builtin:"):
        raise ExperimentError(f"model: {exp.model!r} is made by the driver's warm start on this machine; "
                              "--launcher k8s needs a model the pods load (a built-in name such as tiny, or a "
                              "directory in the image or on kubernetes.model_claim)")
    docs = Manifests(exp, cfg, kube).objects()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("[0-9][0-9]-*.yaml"):  # a render replaces the last one whole
        old.unlink()
    for i, doc in enumerate(docs):
        path = out / f"{i:02d}-{doc['kind'].lower()}-{doc['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        if doc["kind"] == "Secret":
            path.chmod(0o600)
    return out


def submit(out: Path) -> str:
    """``kubectl apply`` the rendered directory; returns what kubectl said. ExperimentError where it refuses."""
    if not shutil.which("kubectl"):
        raise ExperimentError("--submit: kubectl is not installed here (apply the rendered directory where it is: "
                              f"kubectl apply -f {out})")
    done = subprocess.run(["kubectl", "apply", "-f", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ExperimentError(f"--submit: kubectl apply refused {out}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


def dns_label(text: str, limit: int = 40) -> str:
    """``text`` as a DNS label (Service and pod names): lower case, letters, digits and '-'."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-")
    return label or "polar"


class Manifests:
    """The objects of one run, named after it (several runs share a namespace)."""

    def __init__(self, exp: Experiment, cfg: RunConfig, kube: KubernetesSettings):
        self.exp, self.kube = exp, kube
        self.name = dns_label(cfg.run_id)
        self.labels = {"app.kubernetes.io/name": "polarstream", "app.kubernetes.io/instance": self.name}
        base = Settings()
        # an external Kafka and S3 where the environment names them; else the ones rendered here
        # (the environment's, not the default's: a bootstrap the settings derive is this machine's loopback)
        self.own_kafka = not os.environ.get("POLAR_KAFKA_BOOTSTRAP")
        self.own_s3 = not base.s3_endpoint
        secret_values = self._secrets(base)
        base = base.model_copy(update={
            **({"kafka_bootstrap": f"{self.name}-kafka-0.{self.name}-kafka:{KAFKA_PORT}"} if self.own_kafka else {}),
            **({"s3_endpoint": f"http://{self.name}-s3:{S3_PORT}", "s3_port": S3_PORT} if self.own_s3 else {}),
            # every pod announces its own address and listens on every interface (components.py: --host)
            "advertised_host": "$(POD_IP)", **{k.removeprefix("POLAR_").lower(): v for k, v in secret_values.items()}})
        self.settings = run_settings(base, cfg.run_id)
        self.secret_values = secret_values
        self.urls = {"engine": f"http://{self.name}-engine:{PORTS['engine']}",
                     "gateway": f"http://{self.name}-node:{PORTS['gateway']}",
                     "rollout": f"http://{self.name}-rollout:{PORTS['rollout']}", "ui": "",
                     "streams_metrics": "", "trainer_metrics": ""}
        # torchrun's rendezvous at node 0's pod: the indexed Job's pods are named <job>-<index> in its Service
        self.cfg = dataclasses.replace(cfg, trainer_rendezvous=f"{self.name}-trainer-0.{self.name}-trainer:{RENDEZVOUS_PORT}")
        self.model = Path(exp.model)  # a name the pods resolve (tiny) or a directory they have at this path
        self.model_dir = self.model if self.model.is_absolute() else None

    @staticmethod
    def _secrets(base: Settings) -> dict[str, str]:
        """The Secret's values: the settings', except the public development tokens, which a server refuses
        off loopback (gateway/exposure.py): fresh random ones in their place."""
        return {"POLAR_S3_ACCESS_KEY": base.s3_access_key, "POLAR_S3_SECRET_KEY": base.s3_secret_key,
                "POLAR_ADMIN_TOKEN": base.admin_token if base.admin_token != DEV_ADMIN_TOKEN else secrets.token_urlsafe(24),
                "POLAR_SESSION_SECRET": (base.session_secret if base.session_secret != DEV_SESSION_SECRET
                                         else secrets.token_urlsafe(32))}

    def meta(self, component: str) -> dict[str, Any]:
        meta = {"name": f"{self.name}-{component}", "labels": {**self.labels, "app.kubernetes.io/component": component}}
        if self.kube.namespace:
            meta["namespace"] = self.kube.namespace
        return meta

    def selector(self, component: str) -> dict[str, str]:
        return {**self.labels, "app.kubernetes.io/component": component}

    # -- the pieces of a pod ---------------------------------------------------------------------------------
    def env(self, extra: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """A component's environment: child_env's, the secrets by reference, and its pod's IP first (the
        advertised host refers to it as $(POD_IP), which Kubernetes expands from the variables before it)."""
        values = {**child_env(self.settings, RUN_DIR), **(extra or {})}
        env: list[dict[str, Any]] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": f"{self.name}-secrets", "key": k}}} for k in SECRET_ENV]
        env += [{"name": k, "value": v} for k, v in sorted(values.items()) if k not in SECRET_ENV]
        return env

    def container(self, component: str, command: tuple[str, ...], ports: dict[str, int], gpus: int = 0,
                  extra_env: dict[str, str] | None = None) -> dict[str, Any]:
        c: dict[str, Any] = {"name": component, "image": self.kube.image, "imagePullPolicy": "IfNotPresent",
                             "command": list(command), "env": self.env(extra_env),
                             "volumeMounts": [{"name": "run", "mountPath": str(RUN_DIR)}]}
        if ports:
            c["ports"] = [{"name": name.replace("_", "-")[:15], "containerPort": port} for name, port in ports.items()]
        if gpus:
            c["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
        if self.kube.model_claim and self.model_dir is not None:
            c["volumeMounts"].append({"name": "model", "mountPath": str(self.model_dir), "readOnly": True})
        return c

    def init(self) -> list[dict[str, Any]]:
        """Before a component starts: the run's topics (and the in-cluster S3's bucket), which must exist
        whichever pod comes up first; each retries until Kafka and S3 answer."""
        steps = ["polarstream infra topics"]
        if self.own_s3:
            steps.append('python -c "from infra.s3 import ensure_bucket; from infra.settings import Settings; '
                         'ensure_bucket(Settings())"')
        return [{"name": "topics", "image": self.kube.image, "imagePullPolicy": "IfNotPresent",
                 "command": ["sh", "-c", " && ".join(steps)], "env": self.env()}]

    def pod(self, component: str, containers: list[dict[str, Any]], restart: str = "Always",
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
        volumes: list[dict[str, Any]] = [{"name": "run", "emptyDir": {}}]
        if self.kube.model_claim and self.model_dir is not None:
            volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": self.kube.model_claim, "readOnly": True}})
        spec = {"restartPolicy": restart, "initContainers": self.init(), "containers": containers, "volumes": volumes,
                **(extra or {})}
        return {"metadata": {"labels": self.selector(component)}, "spec": spec}

    def args(self, component: str, node_rank: str | None = None) -> tuple[str, ...]:
        return command_line(component_args(component, self.cfg, self.settings, PORTS, self.urls, self.model,
                                           self.exp.runtime, RUN_DIR, node_rank=node_rank))

    # -- the objects --------------------------------------------------------------------------------------------
    def service(self, component: str, ports: dict[str, int], headless: bool = False) -> dict[str, Any]:
        spec: dict[str, Any] = {"selector": self.selector(component),
                                "ports": [{"name": n.replace("_", "-")[:15], "port": p, "targetPort": p}
                                          for n, p in ports.items()]}
        if headless:  # each pod by name (<pod>.<service>), ready or not: a rendezvous needs them before then
            spec.update(clusterIP="None", publishNotReadyAddresses=True)
        return {"apiVersion": "v1", "kind": "Service", "metadata": self.meta(component), "spec": spec}

    def deployment(self, component: str, replicas: int, container: dict[str, Any],
                   pod_extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": self.meta(component),
                "spec": {"replicas": replicas, "selector": {"matchLabels": self.selector(component)},
                         "template": self.pod(component, [container], extra=pod_extra)}}

    def objects(self) -> list[dict[str, Any]]:
        n, kube, cfg = self.name, self.kube, self.cfg
        docs: list[dict[str, Any]] = [
            {"apiVersion": "v1", "kind": "Secret", "metadata": self.meta("secrets"), "type": "Opaque",
             "stringData": self.secret_values},
            self.experiment_configmap(),
        ]
        if self.own_kafka:
            docs += self.kafka()
        if self.own_s3:
            docs += self.s3()
        docs += [
            self.service("engine", {"engine": PORTS["engine"]}),
            self.deployment("engine", 1, self.container("engine", self.args("engine"), {"engine": PORTS["engine"]},
                                                        gpus=kube.engine_gpus)),
            self.service("node", {"gateway": PORTS["gateway"]}),
            # the sessions' sandbox (bwrap) makes namespaces of its own: not under the default seccomp profile
            self.deployment("node", kube.nodes, self.container("node", self.args("node"), {"gateway": PORTS["gateway"]}),
                            pod_extra={"securityContext": {"seccompProfile": {"type": "Unconfined"},
                                                           "appArmorProfile": {"type": "Unconfined"}}}),
            self.deployment("streams", kube.streams, self.container("streams", self.args("streams"),
                                                                    {"metrics": PORTS["streams_metrics"]})),
            self.service("rollout", {"rollout": PORTS["rollout"]}),
            self.deployment("rollout", 1, self.container("rollout", self.args("rollout"), {"rollout": PORTS["rollout"]})),
            self.service("trainer", {"rendezvous": RENDEZVOUS_PORT}, headless=True),
            self.trainer_job(),
            self.driver_job(),
        ]
        return docs

    def trainer_job(self) -> dict[str, Any]:
        """One pod per trainer machine (``trainer: nodes``), each torchrun with ``nproc`` processes; a pod that
        fails is started again (the trainer resumes from its newest checkpoint), as the driver restarts its own."""
        nodes = self.cfg.trainer_nodes
        container = self.container("trainer", self.args("trainer", node_rank="$(JOB_COMPLETION_INDEX)"),
                                   {"rendezvous": RENDEZVOUS_PORT, "metrics": PORTS["trainer_metrics"]},
                                   gpus=self.kube.trainer_gpus)
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": self.meta("trainer"),
                "spec": {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
                         "backoffLimit": 3 * nodes,
                         "template": self.pod("trainer", [container], restart="OnFailure",
                                              extra={"subdomain": f"{self.name}-trainer"})}}

    def driver_job(self) -> dict[str, Any]:
        """The driver: it sends the steps and evals, waits for them, writes the report (in its pod's log and
        run dir); a driver started again resumes from the topics."""
        command = ("polarstream", "run", str(EXPERIMENT_DIR / "experiment.yaml"), "--driver-only", "--run-dir", str(RUN_DIR))
        container = self.container("driver", command, {})
        container["volumeMounts"].append({"name": "experiment", "mountPath": str(EXPERIMENT_DIR), "readOnly": True})
        pod = self.pod("driver", [container], restart="OnFailure")
        pod["spec"]["volumes"].append({"name": "experiment", "configMap": {"name": f"{self.name}-experiment"}})
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": self.meta("driver"),
                "spec": {"backoffLimit": 3, "template": pod}}

    def experiment_configmap(self) -> dict[str, Any]:
        """The experiment as the driver's pod reads it: its components' Services as their URLs, and its task
        files beside it (a Harbor task directory does not fit a ConfigMap: the image or a volume holds those)."""
        exp = self.exp
        files: dict[str, str] = {}
        driven = {**exp.model_dump(mode="json", exclude_defaults=True, exclude={"kubernetes"}), "run_id": self.cfg.run_id,
                  "model": str(self.model), "engine_url": self.urls["engine"], "gateway_url": self.urls["gateway"],
                  "rollout_url": self.urls["rollout"]}
        for key in ("train", "eval"):
            source = getattr(exp, key)
            if not source or source.startswith("builtin:"):
                continue
            path = Path(source)
            if not path.is_file():
                raise ExperimentError(f"{key}: {source!r} is a directory; --launcher k8s sends the driver its task "
                                      "files in a ConfigMap: give a .jsonl file (Harbor task directories: in the image)")
            name = f"{key}{''.join(path.suffixes)}"
            files[name] = path.read_text()
            driven[key] = str(EXPERIMENT_DIR / name)
        files["experiment.yaml"] = (f"# {exp.name} as the driver's pod runs it (--driver-only): rendered by "
                                    "polarstream run --launcher k8s\n" + yaml.safe_dump(driven, sort_keys=False))
        size = sum(len(v.encode()) for v in files.values())
        if size > CONFIGMAP_MAX:
            raise ExperimentError(f"train: the task files come to {size >> 10} KiB, more than a ConfigMap holds "
                                  f"({CONFIGMAP_MAX >> 10} KiB with the experiment): put them in the image")
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": self.meta("experiment"), "data": files}

    def kafka(self) -> list[dict[str, Any]]:
        """One KRaft broker+controller (infra/kafka.py's settings, as the official image takes them: KAFKA_*
        environment variables), its data on a volume of its own."""
        from infra.kafka import broker_properties

        props = broker_properties(self.settings, Path("/var/lib/kafka/data"))
        props.update({"listeners": f"PLAINTEXT://0.0.0.0:{KAFKA_PORT},CONTROLLER://127.0.0.1:9093",
                      "advertised.listeners": f"PLAINTEXT://{self.settings.kafka_bootstrap}",
                      "controller.quorum.voters": "1@127.0.0.1:9093"})
        env = [{"name": "KAFKA_" + k.replace("_", "__").replace("-", "___").replace(".", "_").upper(), "value": v}
               for k, v in props.items()]
        # a KRaft cluster id (a UUID, base64 without padding), the same on every render of this run
        cluster_id = base64.urlsafe_b64encode(uuid.uuid5(uuid.NAMESPACE_URL, f"polarstream:{self.name}").bytes)
        env.append({"name": "CLUSTER_ID", "value": cluster_id.decode().rstrip("=")})
        container = {"name": "kafka", "image": self.kube.kafka_image, "imagePullPolicy": "IfNotPresent", "env": env,
                     "ports": [{"name": "kafka", "containerPort": KAFKA_PORT}],
                     "volumeMounts": [{"name": "data", "mountPath": "/var/lib/kafka/data"}]}
        # the image runs as appuser (uid 1000): the volume is made writable for its group
        return [self.service("kafka", {"kafka": KAFKA_PORT}, headless=True),
                self.stateful("kafka", container, "20Gi", {"securityContext": {"fsGroup": 1000}})]

    def s3(self) -> list[dict[str, Any]]:
        """s3proxy on its filesystem backend (infra/s3.py's settings, as its image takes them)."""
        env = [{"name": "S3PROXY_IDENTITY", "valueFrom": {"secretKeyRef": {"name": f"{self.name}-secrets", "key": "POLAR_S3_ACCESS_KEY"}}},
               {"name": "S3PROXY_CREDENTIAL", "valueFrom": {"secretKeyRef": {"name": f"{self.name}-secrets", "key": "POLAR_S3_SECRET_KEY"}}},
               {"name": "S3PROXY_AUTHORIZATION", "value": "aws-v2-or-v4"},
               {"name": "S3PROXY_ENDPOINT", "value": f"http://0.0.0.0:{S3_PORT}"},
               {"name": "JCLOUDS_PROVIDER", "value": "filesystem"},
               {"name": "JCLOUDS_FILESYSTEM_BASEDIR", "value": "/data"}]
        container = {"name": "s3", "image": self.kube.s3_image, "imagePullPolicy": "IfNotPresent", "env": env,
                     "ports": [{"name": "s3", "containerPort": S3_PORT}],
                     "volumeMounts": [{"name": "data", "mountPath": "/data"}]}
        return [self.service("s3", {"s3": S3_PORT}), self.stateful("s3", container, "50Gi")]

    def stateful(self, component: str, container: dict[str, Any], size: str,
                 pod_extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": self.meta(component),
                "spec": {"serviceName": f"{self.name}-{component}", "replicas": 1,
                         "selector": {"matchLabels": self.selector(component)},
                         "template": {"metadata": {"labels": self.selector(component)},
                                      "spec": {"containers": [container], **(pod_extra or {})}},
                         "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                             "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}}]}}
