"""The operator's RBAC is least privilege: no wildcard anywhere, exactly the verbs it uses on the
resources it uses, bound to the ServiceAccount its Deployment runs as; cluster-wide only when it
watches every namespace, else Roles in the watched namespaces and a ClusterRole for what is
cluster-scoped (nodes, and the CRDs and namespaces kopf observes)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from chart_harness import NAMESPACE, Rendered

from tracehound.controller.orchestrators.jobspec import GROUP, PLURAL

Grants = dict[tuple[str, str], set[str]]

# What the operator does in the namespaces it watches.
NAMESPACED: Grants = {
    (GROUP, PLURAL): {"get", "list", "watch", "patch"},
    (GROUP, f"{PLURAL}/status"): {"get", "patch", "update"},
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
    ("", "services"): {"get", "list", "create", "delete"},  # delete: with its TrainingJob
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
}
# Cluster-scoped: cordon and taint nodes; kopf's runtime observation of CRDs and namespaces
# (kopf's deployment docs; ScanningSettings in kopf/_cogs/configs/configuration.py).
CLUSTER: Grants = {
    ("", "nodes"): {"get", "list", "watch", "patch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
}
WATCHED = ("ml-team-a", "ml-team-b")  # custom-values.yaml


def grants(rules: list[dict[str, Any]]) -> Grants:
    out: Grants = defaultdict(set)
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out[(group, resource)] |= set(rule["verbs"])
    return dict(out)


def operator_account(rendered: Rendered) -> tuple[str, str]:
    deployment = rendered.one("Deployment", "tracehound-operator")
    return deployment["spec"]["template"]["spec"]["serviceAccountName"], NAMESPACE


def _binds(binding: dict[str, Any], account: tuple[str, str]) -> bool:
    return any(s["kind"] == "ServiceAccount" and (s["name"], s["namespace"]) == account
               for s in binding["subjects"])


def cluster_grants(rendered: Rendered) -> Grants:
    """What the operator's account may do cluster-wide (ClusterRoles bound by
    ClusterRoleBindings)."""
    account = operator_account(rendered)
    rules = []
    for binding in rendered.of_kind("ClusterRoleBinding"):
        if _binds(binding, account):
            assert binding["roleRef"]["kind"] == "ClusterRole"
            rules += rendered.one("ClusterRole", binding["roleRef"]["name"])["rules"]
    return grants(rules)


def namespace_grants(rendered: Rendered) -> dict[str, Grants]:
    """What the operator's account may do in each namespace (Roles bound by RoleBindings)."""
    account = operator_account(rendered)
    out: dict[str, Grants] = {}
    for binding in rendered.of_kind("RoleBinding"):
        if not _binds(binding, account):
            continue
        namespace = binding["metadata"]["namespace"]
        assert binding["roleRef"]["kind"] == "Role", "a ClusterRole bound per namespace"
        role = [r for r in rendered.of_kind("Role") if r["metadata"]["name"]
                == binding["roleRef"]["name"] and r["metadata"]["namespace"] == namespace]
        assert len(role) == 1, f"RoleBinding in {namespace}: its Role is not rendered there"
        out[namespace] = grants(role[0]["rules"])
    return out


def test_no_wildcard_in_any_rule(render: Rendered) -> None:
    roles = render.of_kind("ClusterRole") + render.of_kind("Role")
    assert roles
    for role in roles:
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule
            assert "resourceNames" not in rule or "*" not in rule["resourceNames"]
            for field in ("apiGroups", "resources", "verbs"):
                assert rule[field], f"{role['metadata']['name']}: empty {field}"
                assert not any("*" in item for item in rule[field]), (
                    f"{role['metadata']['name']}: a wildcard in {field}: {rule[field]}")


def test_watching_every_namespace_grants_exactly_what_the_operator_uses_cluster_wide(
        default_render: Rendered) -> None:
    assert cluster_grants(default_render) == NAMESPACED | CLUSTER
    assert namespace_grants(default_render) == {}
    assert default_render.of_kind("Role") == []


def test_watched_namespaces_get_roles_and_the_cluster_role_keeps_cluster_scoped_rights_only(
        custom_render: Rendered) -> None:
    assert cluster_grants(custom_render) == CLUSTER  # no pods, services, events or jobs
    assert namespace_grants(custom_render) == {namespace: NAMESPACED for namespace in WATCHED}


def test_the_bindings_name_the_account_that_is_rendered(render: Rendered) -> None:
    name, namespace = operator_account(render)
    account = render.one("ServiceAccount", name)
    assert account["metadata"]["namespace"] == namespace
    for binding in render.of_kind("ClusterRoleBinding") + render.of_kind("RoleBinding"):
        assert _binds(binding, (name, namespace))


def test_only_the_operator_gets_an_api_token(render: Rendered) -> None:
    for doc in render.docs:
        if doc["kind"] in ("Deployment", "DaemonSet"):
            spec = doc["spec"]["template"]["spec"]
            is_operator = doc["metadata"]["name"] == "tracehound-operator"
            assert spec.get("automountServiceAccountToken") is is_operator, doc["metadata"]
