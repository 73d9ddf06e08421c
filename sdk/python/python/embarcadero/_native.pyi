"""Types of the native module (the Rust binding); the public names are re-exported by
``embarcadero``. Durations given as options end in ``_ms``; call timeouts are seconds, as in
the standard library."""

from types import TracebackType
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Literal,
    Optional,
    Sequence,
    Tuple,
    TypedDict,
    Union,
    overload,
)

from typing_extensions import TypeAlias

DEFAULT_CONTROL: str
"""``"127.0.0.1:12140"``, where ``embarcadero serve`` serves its admin API by default."""

Payload: TypeAlias = Union[bytes, bytearray, str]
"""A message: bytes as they are, a ``str`` as UTF-8."""

Position: TypeAlias = Union[int, List[int]]
"""A global position (orders 2 and 5) or one position per broker (orders 0 and 1)."""

Transport: TypeAlias = Literal["auto", "tcp", "shm"]
"""How a client reaches its brokers (the Rust client's ``Transport``, the CLI's
``--transport``)."""

class BrokerLog(TypedDict):
    broker: int
    written_batches: int
    messages: int
    ordered_batches: int
    durable_batches: int
    reclaimed_batches: int

class ReaderLag(TypedDict, total=False):
    slot: int
    broker: Optional[int]
    position: int
    log_broker: int
    """Orders 0 and 1 only: whose log ``position`` is in."""
    behind: int
    heartbeat_age_ms: int

class ReplicaError(TypedDict):
    replica: int
    errno: int
    message: str

class TopicHealth(TypedDict, total=False):
    """Absent keys mean none."""

    readers: int
    slowest_reader: ReaderLag
    replica_errors: List[ReplicaError]

class TopicInfo(TypedDict):
    name: str
    id: int
    order: int
    replication_factor: int
    default_ack: int
    retention_bytes: int
    retention_ms: int
    created_unix_ms: int
    committed_batches: int
    durable_batches: int
    durable_position: int
    next_position: int
    brokers: List[BrokerLog]
    health: TopicHealth

class DeletedTopicInfo(TopicInfo):
    """What ``delete_topic`` returns: the topic as it was just before, marked deleted."""
    deleted: bool

class BrokerAddr(TypedDict):
    id: int
    addr: str
    incarnation: int

class ClusterInfo(TypedDict):
    brokers: List[BrokerAddr]
    max_message_bytes: int
    max_batch_bytes: int

class LatencySummary(TypedDict):
    count: int
    p50: int
    p90: int
    p99: int
    p999: int
    max: int

class QueueStats(TypedDict):
    broker: str
    connection: int
    transport: Literal["tcp", "shm"]
    """How this connection reaches its broker now."""
    batches: int
    acked_batches: int
    deflected: int
    producer_waits: int
    backpressure_retries: int
    lingered: int
    in_place: int
    """Batches built in place in this connection's shared-memory ring."""
    copied_out: int
    """Of those, batches copied out of the ring before their acknowledgement for room."""

class PublisherStats(TypedDict):
    client_id: int
    ack_level: int
    """The acknowledgement level the publisher waits for."""
    session_epoch: int
    """Order 5: the session epoch the publisher opened and publishes in now; else 0."""
    messages: int
    bytes: int
    batches: int
    acked_batches: int
    ack_latency_us: LatencySummary
    append_to_ack_us: LatencySummary
    queues: List[QueueStats]

class Admin:
    """Client of the control plane's admin API at ``control`` (``host:port``)."""

    def __init__(self, control: Optional[str] = None, *, timeout: float = 20.0) -> None:
        """``control``: default ``EMBARCADERO_CONTROL``, else ``127.0.0.1:12140``.
        ``timeout``: seconds each request may take (above the head's longest wait)."""
    @property
    def control_url(self) -> str: ...
    def create_topic(
        self,
        name: str,
        order: Literal[0, 1, 2, 5] = 2,
        *,
        rf: Optional[int] = None,
        memory_only: bool = False,
        default_ack: Literal[0, 1, 2] = 1,
        retention_bytes: Optional[int] = None,
        retention_ms: Optional[int] = None,
    ) -> TopicInfo:
        """Creates topic ``name``, with the CLI's defaults: ``rf`` 2 (one disk replica, the
        data survives restarts) for orders 2 and 5, 1 for orders 0 and 1;
        ``memory_only=True`` asks for rf 1. Raises ``InvalidNameError`` for a name the
        server would refuse, ``AdminError`` (with ``.status``) when the server refuses."""
    def list_topics(self) -> List[TopicInfo]: ...
    def describe_topic(self, name: str) -> TopicInfo:
        """Topic ``name`` with its counters; ``AdminError`` (status 404) if there is none."""
    def cluster(self) -> ClusterInfo:
        """The live brokers and the message and batch size limits."""
    def status(self) -> dict[str, Any]:
        """The raw ``/v1/status`` document (what ``embarcadero status`` prints)."""
    def delete_topic(self, name: str) -> DeletedTopicInfo:
        """Deletes topic ``name`` and returns it as it was just before, with
        ``"deleted": True`` (as the admin API answers). Connected
        publishers and subscribers get ``BrokerError`` with code ``TopicDeleted``; the name
        can be created again as a new topic at once. ``AdminError`` (404) if there is none."""

class Publisher:
    """Publishes to topic ``topic`` through every broker of the cluster whose control plane
    is at ``control`` (``None``: ``EMBARCADERO_CONTROL``, else ``127.0.0.1:12140``), or,
    with ``brokers``, straight to those broker addresses, without failover.

    Options (those of the Rust ``PublisherConfig``):

    - ``ack_level``: 0 fire and forget, 1 acknowledged once ordered (order 0: written),
      2 durable (needs a topic with ``rf`` 2 or more). Default: the topic's
      ``default_ack``, as ``embarcadero pub`` (1 with ``brokers``).
    - ``batch_bytes``: a batch is sealed once it holds this many bytes of messages.
    - ``linger_ms``: a non-empty batch is sealed this long after its first message;
      ``linger_backstop_ms``: a backstop thread seals it that much later still when its
      sender is busy.
    - ``threads_per_broker``: connections (and queues) per broker; ``queue_depth``:
      sealed batches a queue holds before publishing deflects to the next;
      ``max_inflight_batches``: unacknowledged batches per connection; ``deflect``: try the
      next queue when the due one is full.
    - ``client_id``: default random; ``session_key`` (16 bytes) and ``session_epoch``
      (order 5): a program that resumes a session after a restart passes the same
      ``client_id`` and key (see :func:`random_session_key`); epoch 0 picks 1 for order-5
      topics.
    - ``flush_timeout_ms``: longest :meth:`flush` wait.
    - ``failover``: when a broker's connection fails, move its unacknowledged batches to
      the live brokers, resending exactly those not in the order (orders 2 and 5).
    - ``membership_refresh_ms`` / ``max_joined_brokers``: how often to look for brokers
      that joined, and how many may be added.
    - ``slow_queue``: fault injection for experiments, ``(queue, ms)``.
    - ``transport``: ``"auto"`` (shared memory to a broker on this host when a channel
      opens, else TCP), ``"tcp"``, or ``"shm"`` (shared memory or ``ConnectError``); each
      queue's ``transport`` in :meth:`stats` says which it got.
    """

    def __init__(
        self,
        control: Optional[str],
        topic: str,
        *,
        ack_level: Optional[Literal[0, 1, 2]] = None,
        batch_bytes: int = 524288,
        linger_ms: float = 1.0,
        linger_backstop_ms: float = 5.0,
        threads_per_broker: int = 1,
        queue_depth: int = 4,
        max_inflight_batches: int = 16,
        client_id: Optional[int] = None,
        session_key: Optional[bytes] = None,
        session_epoch: int = 0,
        flush_timeout_ms: float = 60000.0,
        deflect: bool = True,
        failover: bool = True,
        membership_refresh_ms: float = 1000.0,
        max_joined_brokers: int = 64,
        slow_queue: Optional[Tuple[int, float]] = None,
        brokers: Optional[Sequence[str]] = None,
        transport: Transport = "auto",
    ) -> None: ...
    def publish(self, message: Payload) -> None:
        """Appends one message to the open batch (not yet acknowledged: see :meth:`flush`).
        Raises ``MessageTooLargeError`` over :attr:`max_message_bytes`, ``ClosedError``
        once closed."""
    def publish_many(self, messages: Iterable[Payload]) -> int:
        """Publishes every message in order, crossing into the client once; returns how
        many. Nothing is published when one is larger than ``max_message_bytes``
        (``MessageTooLargeError``); on a later error those before it were published. A single
        ``str``, ``bytes`` or ``bytearray`` is refused with ``TypeError`` (it would be split
        into one message per character or byte): use :meth:`publish` for one message."""
    def flush(self) -> None:
        """Waits until everything published so far is acknowledged at ``ack_level``."""
    def close(self) -> PublisherStats:
        """Flushes, closes every connection, returns the final statistics."""
    def stats(self) -> PublisherStats: ...
    @property
    def client_id(self) -> int: ...
    @property
    def max_message_bytes(self) -> int: ...
    @property
    def topic(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    @property
    def acked_prefix(self) -> int: ...
    @property
    def batches_sealed(self) -> int: ...
    def __enter__(self) -> Publisher: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException] = None,
        tb: Optional[TracebackType] = None,
    ) -> Literal[False]: ...

class Message:
    """One delivered message."""

    position: int
    """Orders 2 and 5: the position in the total order; orders 0 and 1: in its broker's log."""
    global_seq: Optional[int]
    """Orders 2 and 5: ``position``; ``None`` for orders 0 and 1."""
    broker_id: int
    broker_seq: Optional[int]
    """Orders 0 and 1: ``position`` (in broker ``broker_id``'s log); ``None`` for 2 and 5."""
    client_id: int
    batch_seq: int
    """The publisher's batch sequence (order 5: the session's sequence)."""
    index_in_batch: int
    publish_ts_ns: int
    """When the publisher appended it, nanoseconds since the Unix epoch."""
    payload: bytes

class MessageBatch:
    """Messages delivered together (one poll), in order: ``len(batch)``, ``batch[i]``
    (negative indexes count from the end; a slice gives a ``list``), ``for m in batch``; and
    without making a
    :class:`Message`: :meth:`size`, :meth:`payload`, :meth:`payloads`, :attr:`payload_bytes`.
    The subscriber's position is already past all of them. Holding a batch keeps its
    deliveries' memory (about 1 MiB at most) in use."""

    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, index: int) -> Message:
        """Message ``index`` (its payload copied into a new ``bytes``); ``IndexError``
        outside the batch."""
    @overload
    def __getitem__(self, index: slice) -> List[Message]: ...
    def __iter__(self) -> Iterator[Message]: ...
    def payload(self, index: int) -> bytes:
        """The payload of message ``index``, copied into a new ``bytes``."""
    def size(self, index: int) -> int:
        """The payload length of message ``index`` (nothing copied)."""
    def payloads(self) -> List[bytes]:
        """Every payload in order, each a new ``bytes``; no :class:`Message` made."""
    @property
    def payload_bytes(self) -> int:
        """The payload bytes of all the messages together."""

class Subscriber:
    """Reads topic ``topic`` in order from any broker of the cluster at ``control``
    (``None``: ``EMBARCADERO_CONTROL``, else ``127.0.0.1:12140``), or from the given
    ``brokers``. ``start``: ``None`` (the beginning: the first message
    still retained), a position, a list of positions (one per broker, orders 0 and 1) or
    ``"end"``. A lost connection is retried ``max_reconnects`` times in a row before the
    error is raised, and for ``retry_for_ms`` more once the server is gone: a server
    restarted within it is found again and delivery continues from the position reached
    (as ``embarcadero sub --retry-for``). ``transport``: ``"auto"`` (a shared-memory feed
    from a broker on this host that gives one, else TCP), ``"tcp"``, or ``"shm"``
    (``ConnectError`` where no feed can be had)."""

    def __init__(
        self,
        control: Optional[str],
        topic: str,
        *,
        start: Union[None, int, Sequence[int], Literal["start", "end"]] = None,
        client_id: Optional[int] = None,
        max_reconnects: int = 10,
        brokers: Optional[Sequence[str]] = None,
        transport: Transport = "auto",
        retry_for_ms: Optional[float] = None,
    ) -> None: ...
    def poll(self, timeout: Optional[float] = None) -> Optional[Message]:
        """The next message within ``timeout`` seconds (``None``: wait for one)."""
    def poll_many(
        self, timeout: Optional[float] = None, max_messages: Optional[int] = None
    ) -> List[Message]:
        """Every ready message (at least one unless ``timeout`` runs out)."""
    def poll_batch(self, timeout: Optional[float] = None) -> MessageBatch:
        """The next poll's messages (up to about 1 MiB) as one batch, within ``timeout``
        seconds (``None``: wait for one); empty when the time runs out. Nothing is made
        per message until asked for: the cheapest way to read a stream."""
    def seek(self, position: Union[None, int, Sequence[int], Literal["start", "end"]]) -> None:
        """Continues from ``position`` (as ``start``), dropping what was read ahead. A
        position past the topic's end is not an error: delivery starts with the message
        published there, once it is. One no longer retained is a ``BrokerError``
        (``PositionNotRetained``), naming the first position still there."""
    @property
    def position(self) -> Position:
        """Where the next message :meth:`poll` returns is."""
    @property
    def skipped(self) -> Optional[Tuple[int, int]]:
        """Orders 2 and 5, a subscriber from the beginning (``start=None``): the positions
        ``(from, to)``, ``to`` excluded, reclaimed before it started and so skipped (its
        first message is at ``to``); ``None`` when nothing was. A subscriber given a
        position never skips: one no longer retained raises ``BrokerError``
        (``PositionNotRetained``)."""
    @property
    def transport(self) -> Literal["tcp", "shm", "none"]:
        """How the current connection reaches its broker (``"none"`` between connections),
        as of the latest poll read ahead: never waits for one under way."""
    @property
    def order(self) -> int: ...
    @property
    def topic(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def _fill(self, timeout: float) -> bool: ...
    def _take(self) -> Optional[Message]: ...
    def _take_batch(self) -> MessageBatch: ...
    def __iter__(self) -> Iterator[Message]: ...
    def __next__(self) -> Message: ...
    def __enter__(self) -> Subscriber: ...
    def __exit__(self, *args: object) -> Literal[False]: ...

def random_session_key() -> bytes:
    """16 random bytes for ``Publisher(session_key=...)`` (order 5)."""

class Checkpoint(TypedDict):
    """A batch worker instance's saved progress."""

    cursor: Any
    items_done: int
    partial: Any

class BatchInput:
    """What an instance of a batch worker step is given (``StepContext.batch``)."""

    @property
    def cursor(self) -> Any:
        """The cursor the batchable step gave this instance."""
    @property
    def index(self) -> int:
        """1-based, of :attr:`count`."""
    @property
    def count(self) -> int: ...
    @property
    def resume(self) -> Optional[Checkpoint]:
        """The last checkpoint an earlier attempt of this instance saved."""
    def checkpoint(self, cursor: Any, items_done: int, partial: Any = None) -> None:
        """Saves a checkpoint for the next attempt to resume from."""

class StepContext:
    """What a step handler is given (the same as a Rust handler's ``StepContext``)."""

    @property
    def task_uuid(self) -> str: ...
    @property
    def step_name(self) -> str: ...
    @property
    def attempt(self) -> int:
        """1 for the first attempt."""
    @property
    def context(self) -> Any:
        """The task's input."""
    @property
    def initialization(self) -> Any:
        """The step's ``handler.initialization`` (``None`` when absent)."""
    @property
    def ancestors(self) -> Dict[str, Any]:
        """The results of every ancestor step (direct and indirect), by step name."""
    @property
    def dependencies(self) -> List[str]:
        """The step's direct dependencies that exist, in the template's order."""
    @property
    def dependency_results(self) -> Dict[str, Any]:
        """The results of the direct dependencies, by step name, in that order."""
    @property
    def batch(self) -> Optional[BatchInput]:
        """For an instance of a batch worker step; else ``None``."""
    @property
    def deadline(self) -> float:
        """When the worker reports this attempt timed out, on :func:`time.monotonic`'s clock."""
    def time_left(self) -> float:
        """Seconds until :attr:`deadline`, 0.0 once it has passed: a handler that may run
        long checks it and returns, for a timed-out attempt's outcome is dropped."""
    @property
    def cancelled(self) -> bool:
        """Whether the attempt was called off before its deadline (its task cancelled or
        resolved by hand, or the attempt taken back): its outcome is no longer wanted."""
    def should_stop(self) -> bool:
        """Whether the handler should stop: past its deadline, or :attr:`cancelled`."""

class NativeWorker:
    """The engine's worker loop running Python handlers, replaced by a new worker when its
    log is lost (``embarcadero.workflow.Worker`` wraps it)."""

    def __init__(
        self,
        handlers: Dict[str, Callable[[StepContext], Any]],
        control: Optional[str] = None,
        *,
        namespaces: List[str] = ...,
        concurrency: int = 32,
        lease_ms: int = 3000,
        topic: str = "workflow.events",
        ack: int = 2,
        rf: int = 2,
        retry_for_ms: Optional[int] = None,
        report: Optional[Callable[[str, Optional[str], str], None]] = None,
    ) -> None:
        """``retry_for_ms``: how long a lost log is waited for (``None``: for ever);
        ``report(kind, worker, message)`` is called (from the supervisor's thread) on each
        failure and restart."""
    @property
    def id(self) -> str:
        """The current worker's id (a new one after each restart)."""
    def wait(self, timeout: Optional[float] = None) -> bool:
        """Whether the supervised loop has ended for good, waiting at most ``timeout``
        seconds."""
    def is_finished(self) -> bool: ...
    def stop(self) -> None:
        """Stops claiming, waits until every attempt started has published its result and
        the log acknowledged it (not from inside a handler: there it only stops claiming;
        during a restart's backoff it returns at once); raises the error that ended the
        loop for good, if one did. Idempotent."""


def mark_handler_thread() -> None:
    """Marks the calling thread, for good, as one that runs step handlers (the process's
    event loop of ``async`` handlers): :meth:`NativeWorker.stop` from it begins the drain
    and returns."""

class NativeTaskClient:
    """The workflow API through the Rust ``ApiClient`` (``embarcadero.workflow.TaskClient``
    wraps it); errors are ``WorkflowApiError``."""

    def __init__(self, control: Optional[str] = None, timeout: float = 20.0) -> None: ...
    @property
    def url(self) -> str: ...
    def register_template(self, yaml: str) -> Any: ...
    def newest_version(self, namespace: str, name: str) -> str: ...
    def create_task(
        self,
        namespace: str,
        name: str,
        version: str,
        context: Any,
        idempotency_key: Optional[str] = None,
    ) -> Tuple[Any, bool]:
        """The task, and whether it existed already (same identity)."""
    def wait_task(self, uuid: str, timeout: Optional[float] = None) -> Tuple[Any, bool]:
        """The task once finished or after ``timeout`` seconds, and whether it finished."""
    def request(self, method: str, path: str, body: Any = None) -> Any: ...
