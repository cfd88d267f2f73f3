"""Perfetto's trace messages, as much of them as a session trace uses, declared with
Perfetto's own field numbers (protos/perfetto/trace/: trace.proto, trace_packet.proto,
track_event/track_descriptor.proto, track_event/track_event.proto,
track_event/debug_annotation.proto) and read with the protobuf library: a trace that
parses here parses as Perfetto reads it."""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto

_MESSAGES: dict[str, list[tuple[str, int, int, str]]] = {
    # name: [(field, number, type, message type or "")]
    "Trace": [("packet", 1, _F.TYPE_MESSAGE, "TracePacket")],
    "TracePacket": [
        ("timestamp", 8, _F.TYPE_UINT64, ""),
        ("trusted_packet_sequence_id", 10, _F.TYPE_UINT32, ""),
        ("track_event", 11, _F.TYPE_MESSAGE, "TrackEvent"),
        ("track_descriptor", 60, _F.TYPE_MESSAGE, "TrackDescriptor"),
    ],
    "TrackDescriptor": [
        ("uuid", 1, _F.TYPE_UINT64, ""),
        ("name", 2, _F.TYPE_STRING, ""),
        ("parent_uuid", 5, _F.TYPE_UINT64, ""),
    ],
    "TrackEvent": [
        ("debug_annotations", 4, _F.TYPE_MESSAGE, "DebugAnnotation"),
        ("type", 9, _F.TYPE_INT32, ""),
        ("track_uuid", 11, _F.TYPE_UINT64, ""),
        ("categories", 22, _F.TYPE_STRING, ""),
        ("name", 23, _F.TYPE_STRING, ""),
    ],
    "DebugAnnotation": [
        ("bool_value", 2, _F.TYPE_BOOL, ""),
        ("uint_value", 3, _F.TYPE_UINT64, ""),
        ("int_value", 4, _F.TYPE_INT64, ""),
        ("double_value", 5, _F.TYPE_DOUBLE, ""),
        ("string_value", 6, _F.TYPE_STRING, ""),
        ("name", 10, _F.TYPE_STRING, ""),
    ],
}
_REPEATED = {("Trace", "packet"), ("TrackEvent", "debug_annotations"), ("TrackEvent", "categories")}


def _trace_class() -> Any:
    file = descriptor_pb2.FileDescriptorProto(
        name="plexrl_test_perfetto.proto", package="perfetto.protos", syntax="proto2"
    )
    for name, fields in _MESSAGES.items():
        message = file.message_type.add(name=name)
        for field, number, kind, type_name in fields:
            label = _F.LABEL_REPEATED if (name, field) in _REPEATED else _F.LABEL_OPTIONAL
            entry = message.field.add(name=field, number=number, type=kind, label=label)
            if type_name:
                entry.type_name = f".perfetto.protos.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("perfetto.protos.Trace"))


Trace = _trace_class()


def parse(data: bytes) -> Any:
    """The trace; raises on bytes protobuf cannot read as one."""
    trace = Trace()
    trace.ParseFromString(data)
    return trace


def slices(trace: Any) -> list[dict[str, Any]]:
    """Every slice, by matching each track's begin and end events in time order:
    {track, name, start, end, args}. Asserts that they nest on every track."""
    open_: dict[int, list[dict[str, Any]]] = {}
    done: list[dict[str, Any]] = []
    last = 0
    for packet in trace.packet:
        if not packet.HasField("track_event"):
            continue
        assert packet.timestamp >= last, "events out of time order"
        last = packet.timestamp
        event = packet.track_event
        stack = open_.setdefault(event.track_uuid, [])
        if event.type == 1:
            args: dict[str, Any] = {}
            for a in event.debug_annotations:
                for value_field in ("string_value", "double_value", "uint_value", "bool_value"):
                    if a.HasField(value_field):
                        args[a.name] = getattr(a, value_field)
            stack.append(
                {
                    "track": event.track_uuid,
                    "name": event.name,
                    "start": packet.timestamp,
                    "args": args,
                    "categories": list(event.categories),
                }
            )
        elif event.type == 2:
            assert stack, "an end without a begin on its track"
            s = stack.pop()
            s["end"] = packet.timestamp
            done.append(s)
    assert all(not stack for stack in open_.values()), "a slice never ended"
    return done


def tracks(trace: Any) -> dict[int, tuple[str, int]]:
    """uuid → (name, parent uuid)."""
    return {
        p.track_descriptor.uuid: (p.track_descriptor.name, p.track_descriptor.parent_uuid)
        for p in trace.packet
        if p.HasField("track_descriptor")
    }
