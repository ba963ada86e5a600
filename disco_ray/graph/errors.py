"""The project's exception hierarchy: every message names the vertex, device and numbers involved."""


class DiscoError(Exception):
    """Base of every error disco-ray raises on purpose."""


class GraphError(DiscoError):
    """A TaskGraph or MemGraph is malformed (unknown input, cycle, shape mismatch, ...)."""


class FormatError(GraphError):
    """A file is not a valid disco-taskgraph / disco-memgraph document."""


class CapacityError(DiscoError):
    """A vertex cannot fit in its GPU's memory, whatever is offloaded."""


class PlanError(DiscoError):
    """The planner could not build a MemGraph."""


class VerifyError(DiscoError):
    """A MemGraph violates a correctness condition of FORMATS.md."""


class RunError(DiscoError):
    """Running a MemGraph failed: a kernel raised, a worker died, an input was refused."""

    step: int | None = None  # of `Program.run_steps`: the step of the call that failed (0-based)


class NonFiniteError(RunError):
    """A weight, logit or loss holds NaN or infinity: names the tensor, or the step and row."""


class FrontendError(DiscoError):
    """A torch module cannot be captured or mapped onto the op set (names the aten op and node)."""


class UsageError(DiscoError):
    """Bad command-line usage or an unparsable argument value."""


def check_header(doc: object, what: str, fmt: str, version: int) -> dict:
    """`doc`, a document's top level; FormatError unless it is an object of this format and version.

    Args:
        what: the document's kind, the messages' prefix ("taskgraph", "memgraph").
        fmt: the "format" it must name (e.g. "disco-taskgraph").
        version: the one "version" this reader reads.
    """
    if not isinstance(doc, dict):
        raise FormatError(f"{what}: top level must be an object")
    if doc.get("format") != fmt:
        raise FormatError(f'{what}: "format" must be {fmt!r}, got {doc.get("format")!r}')
    if doc.get("version") != version:
        raise FormatError(f"{what}: unsupported version {doc.get('version')!r} (this reads {version})")
    return doc
