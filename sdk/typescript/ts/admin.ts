// The admin client: topics and cluster status through the control plane's HTTP API
// (the Rust `Admin`); every request runs off the event loop and answers a Promise.
import { native, Native } from "./native";
import { ConfigError, settle } from "./errors";
import * as check from "./options";

/** The control plane's address when none is given: `EMBARCADERO_CONTROL`, else the server's default. */
export function defaultControl(): string {
  return process.env.EMBARCADERO_CONTROL ?? "127.0.0.1:12140";
}

/** Order levels: 0 none, 1 FIFO per broker, 2 total order, 5 total order with per-session FIFO. */
export type Order = 0 | 1 | 2 | 5;

/** Options of {@link Admin.createTopic}; the defaults are those of `embarcadero topic create`. */
export interface CreateTopicOptions {
  /** Order level (default 2). */
  order?: Order;
  /**
   * Replication factor, counting the in-memory copy. Default: 2 (one disk replica: the data
   * survives restarts) for orders 2 and 5; 1 for orders 0 and 1, which have no global order to replicate.
   */
  rf?: number;
  /** Keep the topic in memory only (rf 1). Cannot be combined with `rf`. */
  memoryOnly?: boolean;
  /** Acknowledgement level the CLI's `pub` uses for this topic when not told (default 1). */
  defaultAck?: 0 | 1 | 2;
  /** Keep at most this many bytes per disk replica (0: no limit; default: the server's). */
  retentionBytes?: number;
  /** Keep data on disk this many milliseconds (0: no limit; default: the server's). */
  retentionMs?: number;
}

/** What {@link Admin.deleteTopic} resolves: the topic as it was just before, marked deleted. */
export type DeletedTopicInfo = TopicInfo & { deleted: true };

/** Every name {@link CreateTopicOptions} has: anything else is refused as a misspelling. */
const CREATE_TOPIC_OPTIONS: check.OptionNames<CreateTopicOptions> = {
  order: true,
  rf: true,
  memoryOnly: true,
  defaultAck: true,
  retentionBytes: true,
  retentionMs: true,
};

/** Options of the {@link Admin} client. */
export interface AdminOptions {
  /** Gives up on a request after this many milliseconds (default 20 s). */
  timeoutMs?: number;
}

const ADMIN_OPTIONS: check.OptionNames<AdminOptions> = { timeoutMs: true };

/** A topic as the control plane describes it. */
export interface TopicInfo {
  /** The topic's name. */
  name: string;
  /** The server's id for it. */
  id: number;
  /** Its order level. */
  order: Order;
  /** Copies of its data, counting the in-memory one (1: memory only). */
  replicationFactor: number;
  /** The ack level the CLI's `pub` uses for it when not told. */
  defaultAck: number;
  /** Disk retention in bytes per replica (0: no limit). */
  retentionBytes: number;
  /** Disk retention in milliseconds (0: no limit). */
  retentionMs: number;
  /** When it was created, milliseconds since the Unix epoch. */
  createdUnixMs: number;
  /** Batches in its global order. */
  committedBatches: number;
  /** Batches of the global order on every disk replica. */
  durableBatches: number;
  /** Replicated topics: subscribers read the positions below this one. */
  durablePosition: number;
  /** The next global position (orders 2 and 5). */
  nextPosition: number;
  /** One entry per broker log. */
  brokers: BrokerLogInfo[];
  /** Readers and failing disk replicas. */
  health: TopicHealth;
}

/** One broker's log of a topic. */
export interface BrokerLogInfo {
  /** The broker's id. */
  broker: number;
  /** Batches written. */
  writtenBatches: number;
  /** Messages written: for orders 0 and 1, the next position in this broker's log. */
  messages: number;
  /** Batches in the global order (orders 2 and 5). */
  orderedBatches: number;
  /** Batches on every disk replica (replicated topics). */
  durableBatches: number;
  /** Batches whose memory was released. */
  reclaimedBatches: number;
}

/** How far the subscriber furthest behind is. */
export interface ReaderLag {
  /** Its reader slot in the topic. */
  slot: number;
  /** The broker serving it, when known. */
  broker: number | null;
  /** The position it still needs (orders 0 and 1: in the log of `logBroker`). */
  position: number;
  /** Orders 0 and 1: whose log `position` is in. */
  logBroker?: number;
  /** Messages written that it has not read yet. */
  behind: number;
  /** Time since its broker last beat for it. */
  heartbeatAgeMs: number;
}

/** A disk replica whose last write or sync failed. */
export interface ReplicaError {
  /** 1-based replica number. */
  replica: number;
  /** The OS error number. */
  errno: number;
  /** The OS error's text. */
  message: string;
}

/** A topic's trouble: the subscriber furthest behind and failing disk replicas. */
export interface TopicHealth {
  /** Subscribers that pin memory now. */
  readers: number;
  /** The subscriber furthest behind, if any is connected. */
  slowestReader?: ReaderLag;
  /** Failing disk replicas (empty when all are healthy). */
  replicaErrors: ReplicaError[];
}

/** A broker clients can reach. */
export interface BrokerAddr {
  /** The broker's id. */
  id: number;
  /** Data address, `host:port`. */
  addr: string;
  /** The process serving the id (0 for the head's own brokers). */
  incarnation: number;
}

/** The cluster as clients see it. */
export interface ClusterInfo {
  /** The live brokers. */
  brokers: BrokerAddr[];
  /** Largest payload the brokers accept, in bytes. */
  maxMessageBytes: number;
  /** Largest batch the brokers accept, in bytes. */
  maxBatchBytes: number;
}

type Json = Record<string, unknown>;

function topicInfo(v: Json): TopicInfo {
  return {
    name: v.name as string,
    id: v.id as number,
    order: v.order as Order,
    replicationFactor: v.replication_factor as number,
    defaultAck: v.default_ack as number,
    retentionBytes: Number(v.retention_bytes ?? 0),
    retentionMs: Number(v.retention_ms ?? 0),
    createdUnixMs: Number(v.created_unix_ms),
    committedBatches: Number(v.committed_batches),
    durableBatches: Number(v.durable_batches ?? 0),
    durablePosition: Number(v.durable_position ?? 0),
    nextPosition: Number(v.next_position),
    brokers: (v.brokers as Json[]).map(brokerLogInfo),
    health: topicHealth((v.health ?? {}) as Json),
  };
}

function brokerLogInfo(b: Json): BrokerLogInfo {
  return {
    broker: Number(b.broker),
    writtenBatches: Number(b.written_batches),
    messages: Number(b.messages),
    orderedBatches: Number(b.ordered_batches),
    durableBatches: Number(b.durable_batches),
    reclaimedBatches: Number(b.reclaimed_batches),
  };
}

function topicHealth(h: Json): TopicHealth {
  const r = h.slowest_reader as Json | undefined;
  const errors = (h.replica_errors ?? []) as Json[];
  return {
    readers: Number(h.readers ?? 0),
    ...(r && {
      slowestReader: {
        slot: Number(r.slot),
        broker: r.broker === null || r.broker === undefined ? null : Number(r.broker),
        position: Number(r.position),
        ...(r.log_broker !== undefined && { logBroker: Number(r.log_broker) }),
        behind: Number(r.behind),
        heartbeatAgeMs: Number(r.heartbeat_age_ms),
      },
    }),
    replicaErrors: errors.map((e) => ({
      replica: Number(e.replica),
      errno: Number(e.errno),
      message: String(e.message),
    })),
  };
}

/** The replication factor `createTopic` asks for, as `embarcadero topic create` picks it. */
export function replicationFactor(order: Order, opts: CreateTopicOptions): number {
  if (opts.rf !== undefined) return opts.rf;
  if (opts.memoryOnly) return 1;
  return order >= 2 ? 2 : 1;
}

/**
 * Client of the admin API (topics and cluster status).
 *
 * @example
 * const admin = new Admin("127.0.0.1:12140");
 * await admin.createTopic("orders", { order: 2 });
 */
export class Admin {
  readonly #native: Native.NativeAdmin;

  /**
   * @param control - The control plane's `host:port` or `http://` URL (default: `EMBARCADERO_CONTROL`, else `127.0.0.1:12140`).
   * @param options - See {@link AdminOptions}; an unknown option is a {@link ConfigError}.
   */
  constructor(control: string = defaultControl(), options: AdminOptions = {}) {
    check.known("Admin", options, ADMIN_OPTIONS);
    this.#native = new native.NativeAdmin(control, check.millis("timeoutMs", options.timeoutMs));
  }

  /**
   * Creates a topic. Durable by default for orders 2 and 5 (rf 2), memory only for orders 0 and 1.
   * @throws {@link InvalidNameError} for a name the server would refuse; {@link AdminError} (409) if it exists.
   */
  async createTopic(name: string, options: CreateTopicOptions = {}): Promise<TopicInfo> {
    check.known("createTopic", options, CREATE_TOPIC_OPTIONS);
    if (options.rf !== undefined && options.memoryOnly) {
      throw new ConfigError("give rf or memoryOnly, not both");
    }
    const order = options.order ?? 2;
    const spec: Native.NativeTopicSpec = {
      name,
      order,
      replicationFactor: replicationFactor(order, options),
      defaultAck: options.defaultAck ?? 1,
      retentionBytes: options.retentionBytes,
      retentionMs: options.retentionMs,
    };
    return topicInfo((await settle(() => this.#native.createTopic(spec))) as Json);
  }

  /** Every topic. */
  async listTopics(): Promise<TopicInfo[]> {
    const list = (await settle(() => this.#native.listTopics())) as Json[];
    return list.map(topicInfo);
  }

  /** One topic with its counters. @throws {@link AdminError} (404) for an unknown topic. */
  async describeTopic(name: string): Promise<TopicInfo> {
    return topicInfo((await settle(() => this.#native.describeTopic(name))) as Json);
  }

  /**
   * Deletes a topic: its connected publishers and subscribers get a `BrokerError`
   * with `code` `"TopicDeleted"`, its memory and disk logs are freed, and the name can
   * be created again at once (as a new topic, positions from 0).
   * Resolves the topic as it was just before, with `deleted: true` (as the admin API answers).
   * @throws {@link AdminError} (404) for an unknown topic.
   */
  async deleteTopic(name: string): Promise<DeletedTopicInfo> {
    const info = topicInfo((await settle(() => this.#native.deleteTopic(name))) as Json);
    return { ...info, deleted: true };
  }

  /** The live brokers and the size limits. */
  async cluster(): Promise<ClusterInfo> {
    const v = (await settle(() => this.#native.cluster())) as Json;
    return {
      brokers: (v.brokers as Json[]).map((b) => ({
        id: b.id as number,
        addr: b.addr as string,
        incarnation: Number(b.incarnation ?? 0),
      })),
      maxMessageBytes: Number(v.max_message_bytes),
      maxBatchBytes: Number(v.max_batch_bytes),
    };
  }

  /** The raw `/v1/status` document (what `embarcadero status --json` prints). */
  async status(): Promise<Record<string, unknown>> {
    return (await settle(() => this.#native.status())) as Json;
  }
}
