"""Checks deploy/: the Kubernetes YAML parses and wires what tinkerd needs (RANK from the pod
ordinal, WORLD_SIZE equal to replicas, MASTER_ADDR pointing at rank 0 through the headless
Service, probes, a grace period longer than tinkerd's); the Slurm script sets the same variables."""
import pathlib
import sys

import yaml

root = pathlib.Path(sys.argv[1])
docs = list(yaml.safe_load_all((root / "deploy/k8s/tinkerd.yaml").read_text()))
kinds = {d["kind"]: d for d in docs if d}
errors = []
sts = next(d for d in docs if d and d["kind"] == "StatefulSet")
headless = next(d for d in docs if d and d["kind"] == "Service" and d["spec"].get("clusterIP") == "None")
client_svc = next(d for d in docs if d and d["kind"] == "Service" and d["spec"].get("clusterIP") != "None")
pod = sts["spec"]["template"]["spec"]
c = pod["containers"][0]
env = {e["name"]: e.get("value") for e in c.get("env", [])}
if sts["spec"]["serviceName"] != headless["metadata"]["name"]:
    errors.append("StatefulSet.serviceName must be the headless Service")
if int(env.get("WORLD_SIZE", -1)) != sts["spec"]["replicas"]:
    errors.append("WORLD_SIZE must equal replicas")
if env.get("MASTER_ADDR") != f"{sts['metadata']['name']}-0.{headless['metadata']['name']}":
    errors.append("MASTER_ADDR must name pod 0 through the headless Service")
if "RANK=\"${HOSTNAME##*-}\"" not in " ".join(c["args"]):
    errors.append("RANK must come from the pod ordinal")
if "readinessProbe" not in c or "livenessProbe" not in c:
    errors.append("probes missing")
if client_svc["spec"]["selector"].get("statefulset.kubernetes.io/pod-name") != "tinkerd-0":
    errors.append("the client Service must select rank 0")
grace = int(" ".join(c["args"]).split("--shutdown_grace_s=")[1].split()[0])
if pod["terminationGracePeriodSeconds"] <= grace:
    errors.append("terminationGracePeriodSeconds must exceed --shutdown_grace_s")
slurm = (root / "deploy/slurm/tinkerd.sbatch").read_text()
for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK=$SLURM_PROCID", "LOCAL_RANK"):
    if var not in slurm:
        errors.append(f"slurm script does not set {var}")
for e in errors:
    print("FAIL:", e)
print(f"{len(docs)} YAML documents checked; {len(errors)} problems")
sys.exit(1 if errors else 0)
