// The `embarcadero` package: a Node.js client for Embarcadero, a thin binding of the
// Rust client (crates/client). See README.md for a quickstart and the design notes.
export { Admin, defaultControl, replicationFactor } from "./admin";
export type {
  AdminOptions,
  BrokerAddr,
  BrokerLogInfo,
  ClusterInfo,
  CreateTopicOptions,
  DeletedTopicInfo,
  Order,
  ReaderLag,
  ReplicaError,
  TopicHealth,
  TopicInfo,
} from "./admin";
export { Publisher } from "./publisher";
export type { LatencySummary, Payload, PublisherOptions, PublisherStats, QueueStats, Transport } from "./publisher";
export { Message, MessageBatch } from "./message";
export { Subscriber } from "./subscriber";
export type { From, Position, Skipped, SubscriberOptions } from "./subscriber";
export {
  AdminError,
  BrokerError,
  ClosedError,
  ConfigError,
  ConnectError,
  ConnectionLostError,
  EmbarcaderoError,
  InvalidNameError,
  MessageTooLargeError,
  NoLiveBrokerError,
  ProtocolError,
  TimeoutError,
  WorkflowApiError,
} from "./errors";
export type { ErrorKind } from "./errors";
export { StepError, Worker, registeredHandlers, stepHandler } from "./workflow";
export { TaskClient } from "./tasks";
export type {
  CreateTaskOptions,
  DeadLetters,
  StepActionOptions,
  Task,
  TaskClientOptions,
  TaskList,
  TaskListOptions,
  TaskStatus,
  TaskStep,
  WaitOptions,
} from "./tasks";
export type {
  BatchInput,
  Checkpoint,
  Json,
  JsonObject,
  RunOptions,
  StepContext,
  StepErrorOptions,
  StepHandler,
  WorkerOptions,
  WorkerRestart,
  HandlerFailure,
} from "./workflow";
