"""A Monarch `KubernetesJob` for composer-mesh: trainer and generator meshes provisioned by the MonarchMesh operator.

    monarch apply configs.jobs.k8s.job
    monarch exec composer-mesh train configs/qwen3_30b_a3b.toml

Needs the `kubernetes` Python client and, in the cluster, the MonarchMesh
operator (pods are created from `ImageSpec`). Environment (defaults in
brackets): COMPOSER_K8S_NAMESPACE [default], COMPOSER_IMAGE (the container
with composer-mesh installed) [ghcr.io/meta-pytorch/monarch:latest],
COMPOSER_TRAINER_PODS [2], COMPOSER_GENERATOR_PODS [1], COMPOSER_GPUS_PER_NODE
[8], COMPOSER_SHM [64Gi] (shared memory for NCCL and the weight-sync files).
"""

from __future__ import annotations

import os

from monarch.job.kubernetes import ImageSpec, KubernetesJob

from composer_mesh.configs.jobs import env_int


def build_job(
    namespace: str = "default",
    image: str = "ghcr.io/meta-pytorch/monarch:latest",
    trainer_pods: int = 2,
    generator_pods: int = 1,
    gpus_per_pod: int = 8,
    shared_memory: str = "64Gi",
) -> KubernetesJob:
    """One MonarchMesh per role; each pod is one host with `gpus_per_pod` GPUs."""
    if trainer_pods < 1 or generator_pods < 1 or gpus_per_pod < 1:
        raise ValueError("trainer_pods, generator_pods and gpus_per_pod must be >= 1")
    job = KubernetesJob(namespace=namespace)
    spec = ImageSpec(image, resources={"nvidia.com/gpu": gpus_per_pod}, shared_memory_size=shared_memory)
    job.add_mesh("trainer", trainer_pods, image_spec=spec, labels={"app": "composer-mesh"})
    job.add_mesh("generator", generator_pods, image_spec=spec, labels={"app": "composer-mesh"})
    return job


job = build_job(
    namespace=os.environ.get("COMPOSER_K8S_NAMESPACE", "default"),
    image=os.environ.get("COMPOSER_IMAGE", "ghcr.io/meta-pytorch/monarch:latest"),
    trainer_pods=env_int("COMPOSER_TRAINER_PODS", 2),
    generator_pods=env_int("COMPOSER_GENERATOR_PODS", 1),
    gpus_per_pod=env_int("COMPOSER_GPUS_PER_NODE", 8),
    shared_memory=os.environ.get("COMPOSER_SHM", "64Gi"),
)
