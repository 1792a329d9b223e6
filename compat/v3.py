"""ComfyUI's V3 node API (`comfy_api.latest`): its `io` and `ComfyExtension`, or a stand-in for them outside ComfyUI,
so the nodes import, introspect and run under pytest and in scripts; and the VIDEO value core's video nodes take."""

from __future__ import annotations


class _FallbackIO:
    """Just enough of `comfy_api.latest.io` to import, introspect and call our V3 nodes
    without ComfyUI (pytest, scripts). Inside ComfyUI the real module is used."""

    class Schema:
        def __init__(self, node_id, display_name=None, category="", inputs=(), outputs=(), description="", **flags):
            self.node_id, self.display_name, self.category = node_id, display_name, category
            self.inputs, self.outputs, self.description = list(inputs), list(outputs), description
            self.flags = flags

    class NodeOutput:
        def __init__(self, *args, ui=None, **_):
            self.args, self.ui = args, ui

        @property
        def result(self):
            return self.args or None

        def __getitem__(self, index):
            return self.args[index]

    class ComfyNode:
        @classmethod
        def define_schema(cls):
            raise NotImplementedError

        @classmethod
        def validate_inputs(cls, **kwargs):
            return True

    class ComfyExtension:
        async def on_load(self):
            pass

    class _Port:
        def __init__(self, io_type, id=None, optional=False, **options):
            self.io_type, self.id, self.optional, self.options = io_type, id, optional, options

    @staticmethod
    def Custom(io_type: str):
        class _Type:
            io_type: str

            @staticmethod
            def Input(id, **kw):
                return _FallbackIO._Port(io_type, id, **kw)

            @staticmethod
            def Output(id=None, **kw):
                return _FallbackIO._Port(io_type, id, **kw)

        _Type.io_type = io_type
        return _Type


for _name, _io_type in [
    ("Vae", "VAE"),
    ("Latent", "LATENT"),
    ("Image", "IMAGE"),
    ("Audio", "AUDIO"),
    ("Video", "VIDEO"),
    ("Model", "MODEL"),
    ("Int", "INT"),
    ("Float", "FLOAT"),
    ("String", "STRING"),
    ("Boolean", "BOOLEAN"),
    ("Combo", "COMBO"),
]:
    setattr(_FallbackIO, _name, _FallbackIO.Custom(_io_type))

try:  # the V3 node API
    from comfy_api.latest import ComfyExtension, io
except Exception:  # pragma: no cover - exercised when ComfyUI is missing
    io, ComfyExtension = _FallbackIO, _FallbackIO.ComfyExtension


def search_aliases(*words: str) -> dict:
    """`search_aliases=[...]` for io.Schema where this ComfyUI's schema has the field (newer than 0.3.64, whose
    frontend searches node ids and display names only); nothing on older ones."""
    fields = getattr(io.Schema, "__dataclass_fields__", None)
    return {"search_aliases": list(words)} if fields is None or "search_aliases" in fields else {}


def video_from_file(path: str):
    """Core's VIDEO value for a video file (what Load Video gives), so Save Video / Get Video Components take it.
    Through the public `comfy_api.latest.InputImpl` (0.3.64 and newer), not the internal module behind it."""
    from comfy_api.latest import InputImpl

    return InputImpl.VideoFromFile(path)
