"""The official Kubernetes Python client (`pip install kubernetes`) against `nodeport apiserver`.

Run by `apiserver_python.rs` as `python3 clients.py <server URL> <case>`; every case raises (and
so exits non-zero with a traceback) at the first thing that is not as on kube-apiserver.
Objects are built the client's usual way: without `api_version` and `kind`.
"""

import sys

from kubernetes import client
from kubernetes.client.rest import ApiException


def api_client(url):
    configuration = client.Configuration()
    configuration.host = url
    return client.ApiClient(configuration)


def expect_status(call, status, message=None):
    try:
        call()
    except ApiException as err:
        assert err.status == status, (err.status, err.body)
        if message is not None:
            assert message in err.body, err.body
        return err
    raise AssertionError(f"expected HTTP {status}, the call succeeded")


def kinds(url):
    """Creates and replaces of every writable served kind, sent without kind and apiVersion."""
    api = api_client(url)
    core = client.CoreV1Api(api)
    discovery = client.DiscoveryV1Api(api)
    meta = client.V1ObjectMeta

    ns = core.create_namespace(client.V1Namespace(metadata=meta(name="py")))
    assert ns.kind == "Namespace" and ns.api_version == "v1", ns
    assert ns.status.phase == "Active", ns

    svc = core.create_namespaced_service(
        "py",
        client.V1Service(
            metadata=meta(name="web", labels={"app": "web"}),
            spec=client.V1ServiceSpec(
                type="NodePort",
                selector={"app": "web"},
                ports=[client.V1ServicePort(port=80)],
            ),
        ),
    )
    assert svc.kind == "Service", svc
    node_port = svc.spec.ports[0].node_port
    assert 30000 <= node_port <= 32767, svc

    # A replace (PUT) without kind, as the client sends it.
    svc.kind = None
    svc.api_version = None
    svc.metadata.labels["replaced"] = "yes"
    replaced = core.replace_namespaced_service("web", "py", svc)
    assert replaced.metadata.labels["replaced"] == "yes", replaced
    assert replaced.spec.ports[0].node_port == node_port, replaced

    ep = core.create_namespaced_endpoints(
        "py",
        client.V1Endpoints(
            metadata=meta(name="web"),
            subsets=[
                client.V1EndpointSubset(
                    addresses=[client.V1EndpointAddress(ip="10.0.0.1")],
                    ports=[client.CoreV1EndpointPort(port=8080)],
                )
            ],
        ),
    )
    assert ep.kind == "Endpoints", ep
    ep.kind = None
    ep.api_version = None
    ep.metadata.labels = {"replaced": "yes"}
    assert core.replace_namespaced_endpoints("web", "py", ep).metadata.labels == {"replaced": "yes"}

    node = core.create_node(client.V1Node(metadata=meta(name="py-node")))
    assert node.kind == "Node", node
    node.kind = None
    node.api_version = None
    node.metadata.labels = {"zone": "a"}
    assert core.replace_node("py-node", node).metadata.labels["zone"] == "a"

    slice_ = discovery.create_namespaced_endpoint_slice(
        "py",
        client.V1EndpointSlice(
            metadata=meta(name="web-1", labels={"kubernetes.io/service-name": "web"}),
            address_type="IPv4",
            endpoints=[client.V1Endpoint(addresses=["10.0.0.1"])],
            ports=[client.DiscoveryV1EndpointPort(port=8080)],
        ),
    )
    assert slice_.kind == "EndpointSlice", slice_
    assert slice_.api_version == "discovery.k8s.io/v1", slice_
    slice_.kind = None
    slice_.api_version = None
    slice_.endpoints[0].addresses = ["10.0.0.2"]
    replaced = discovery.replace_namespaced_endpoint_slice("web-1", "py", slice_)
    assert replaced.endpoints[0].addresses == ["10.0.0.2"], replaced

    ns.kind = None
    ns.api_version = None
    ns.metadata.labels = {"replaced": "yes"}
    assert core.replace_namespace("py", ns).metadata.labels["replaced"] == "yes"

    # ServiceCIDRs are writable (kube 1.33's MultiCIDRServiceAllocator), and IPAddresses may be
    # created to reserve an address: kind and version come from the URL for them too.
    networking = client.NetworkingV1Api(api)
    cidr = networking.create_service_cidr(
        client.V1ServiceCIDR(
            metadata=meta(name="extra"),
            spec=client.V1ServiceCIDRSpec(cidrs=["10.97.0.0/16"]),
        )
    )
    assert cidr.kind == "ServiceCIDR", cidr
    assert cidr.api_version == "networking.k8s.io/v1", cidr
    ip = networking.create_ip_address(
        client.V1IPAddress(
            metadata=meta(name="10.97.0.10"),
            spec=client.V1IPAddressSpec(
                parent_ref=client.V1ParentReference(
                    group="", resource="services", namespace="py", name="web"
                )
            ),
        )
    )
    assert ip.kind == "IPAddress", ip
    assert ip.api_version == "networking.k8s.io/v1", ip

    # The RBAC kinds.
    rbac = client.RbacAuthorizationV1Api(api)
    role = rbac.create_namespaced_role(
        "py",
        client.V1Role(
            metadata=meta(name="reader"),
            rules=[
                client.V1PolicyRule(api_groups=[""], resources=["services"], verbs=["get"])
            ],
        ),
    )
    assert role.kind == "Role", role
    assert role.api_version == "rbac.authorization.k8s.io/v1", role
    binding = rbac.create_namespaced_role_binding(
        "py",
        client.V1RoleBinding(
            metadata=meta(name="reader"),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="Role", name="reader"
            ),
            subjects=[
                client.RbacV1Subject(
                    kind="User", name="alice", api_group="rbac.authorization.k8s.io"
                )
            ],
        ),
    )
    assert binding.kind == "RoleBinding", binding

    # A kind that disagrees with the URL keeps kube's error and status.
    expect_status(
        lambda: core.create_namespaced_service(
            "py", {"kind": "Namespace", "metadata": {"name": "x"}}
        ),
        400,
        "Namespace in version \\\"v1\\\" cannot be handled as a Service: "
        "converting (v1.Namespace) to (core.Service): unknown conversion",
    )
    print("kinds: ok")


def events(url):
    """Events through both APIs, as one set of objects, with their field selectors."""
    import datetime
    import json

    api = api_client(url)
    core = client.CoreV1Api(api)
    events_api = client.EventsV1Api(api)
    meta = client.V1ObjectMeta
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    svc = core.create_namespaced_service(
        "default",
        client.V1Service(
            metadata=meta(name="web"),
            spec=client.V1ServiceSpec(ports=[client.V1ServicePort(port=80)]),
        ),
    )
    ref = client.V1ObjectReference(
        kind="Service", namespace="default", name="web", uid=svc.metadata.uid, api_version="v1"
    )
    legacy = core.create_namespaced_event(
        "default",
        client.CoreV1Event(
            metadata=meta(name="web.legacy"),
            involved_object=ref,
            reason="Synced",
            message="from the legacy API",
            source=client.V1EventSource(component="py-controller"),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            type="Normal",
        ),
    )
    assert legacy.kind == "Event" and legacy.involved_object.uid == svc.metadata.uid, legacy
    new = events_api.create_namespaced_event(
        "default",
        client.EventsV1Event(
            metadata=meta(name="web.new"),
            event_time=now,
            regarding=ref,
            reason="Probed",
            action="Probe",
            note="from events.k8s.io",
            type="Warning",
            reporting_controller="example.com/py",
            reporting_instance="py-1",
        ),
    )
    assert new.api_version == "events.k8s.io/v1" and new.note == "from events.k8s.io", new

    # One set of objects: each is read through the other API.
    # (Read raw: a legacy event has no eventTime, which this client's model requires; kube sends
    # `"eventTime": null` too.)
    raw = events_api.read_namespaced_event("web.legacy", "default", _preload_content=False)
    body = json.loads(raw.data)
    assert body["note"] == "from the legacy API" and body["eventTime"] is None, body
    assert core.read_namespaced_event("web.new", "default").message == "from events.k8s.io"

    selected = core.list_namespaced_event(
        "default", field_selector=f"involvedObject.uid={svc.metadata.uid},type=Warning"
    )
    assert [e.metadata.name for e in selected.items] == ["web.new"], selected
    selected = events_api.list_namespaced_event(
        "default", field_selector="regarding.name=web,reportingController=example.com/py"
    )
    assert [e.metadata.name for e in selected.items] == ["web.new"], selected

    # kube's validation: events.k8s.io/v1 takes only the Normal and Warning types, and the
    # new-style fields.
    expect_status(
        lambda: events_api.create_namespaced_event(
            "default",
            client.EventsV1Event(
                metadata=meta(name="bad"), event_time=now, regarding=ref, type="Info"
            ),
        ),
        422,
        "type: Invalid value: \\\"\\\": has invalid value: Info",
    )
    core.delete_namespaced_event("web.legacy", "default")
    assert [e.metadata.name for e in events_api.list_namespaced_event("default").items] == [
        "web.new"
    ]
    print("events: ok")


def apply(url):
    """Server-side apply through `patch_*` with `application/apply-patch+yaml`, as the client
    documents it: create, managedFields, conflicts with kube's 409, force, and the 422 without a
    field manager."""
    api = api_client(url)
    core = client.CoreV1Api(api)
    config = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "applied", "labels": {"app": "applied"}},
        "spec": {
            "type": "NodePort",
            "selector": {"app": "applied"},
            "ports": [{"name": "http", "port": 80, "nodePort": 30180}],
        },
    }
    apply_type = "application/apply-patch+yaml"
    svc = core.patch_namespaced_service(
        "applied", "default", config, field_manager="py-deployer", _content_type=apply_type
    )
    assert svc.spec.ports[0].node_port == 30180, svc
    assert svc.spec.cluster_ip, svc
    entries = [(e.manager, e.operation) for e in svc.metadata.managed_fields]
    assert entries == [("py-deployer", "Apply")], entries
    fields = svc.metadata.managed_fields[0].fields_v1
    assert 'k:{"port":80,"protocol":"TCP"}' in fields["f:spec"]["f:ports"], fields

    # Another manager changing an owned field: kube's 409 with its message and causes.
    other = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "applied"},
        "spec": {"ports": [{"name": "http", "port": 80, "nodePort": 30181}]},
    }
    err = expect_status(
        lambda: core.patch_namespaced_service(
            "applied", "default", other, field_manager="py-other", _content_type=apply_type
        ),
        409,
        'Apply failed with 1 conflict: conflict with \\"py-deployer\\": '
        '.spec.ports[port=80,protocol=\\"TCP\\"].nodePort',
    )
    assert '"FieldManagerConflict"' in err.body, err.body
    svc = core.patch_namespaced_service(
        "applied",
        "default",
        other,
        field_manager="py-other",
        force=True,
        _content_type=apply_type,
    )
    assert svc.spec.ports[0].node_port == 30181, svc
    assert {e.manager for e in svc.metadata.managed_fields} == {"py-deployer", "py-other"}

    # Without a field manager: kube's 422.
    expect_status(
        lambda: core.patch_namespaced_service(
            "applied", "default", other, _content_type=apply_type
        ),
        422,
        "fieldManager: Required value: is required for apply patch",
    )
    # A plain create records an Update under the client's User-Agent product.
    created = core.create_namespaced_service(
        "default",
        client.V1Service(
            metadata=client.V1ObjectMeta(name="created"),
            spec=client.V1ServiceSpec(ports=[client.V1ServicePort(port=80)]),
        ),
    )
    entries = [(e.manager, e.operation) for e in created.metadata.managed_fields]
    assert entries == [("OpenAPI-Generator", "Update")], entries
    core.delete_namespaced_service("applied", "default")
    core.delete_namespaced_service("created", "default")
    print("apply: ok")


CASES = {"kinds": kinds, "events": events, "apply": apply}

if __name__ == "__main__":
    CASES[sys.argv[2]](sys.argv[1])
