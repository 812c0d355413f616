export {
  CompactdClient,
  MAX_UNREAD_EVENTS,
  collectCompaction,
  updateResult,
  type ClientOptionsInit,
  type CompactionResult,
  type CompactionRun,
  type ImportInit,
  type RecallToolDefinition,
  type ServerStream,
  type SessionInit,
  type UpdateResult,
} from "./client.js";
export {
  DEFAULT_MAX_UPDATE_BYTES,
  MAX_UNSENT,
  SessionStream,
  type SubmittedUpdate,
  type SessionStreamOptions,
  type StreamCompaction,
  type StreamEvents,
  type UpdateBody,
} from "./stream.js";
export { checkSessionConfig } from "./config_keys.js";
export { contextFormat, openaiMessagesOf, type ContextFormatName } from "./context_format.js";
export { CompactdError, codeName, codeNumber, toCompactdError, type CodeName } from "./errors.js";
export type { CallOptions, DeepPartial, JsonValue, OpenAIChatMessage, OpenAITool } from "./types.js";
export * from "./gen/compactd/v1/sessions.js";
export * from "./gen/compactd/v1/session.js";
export { type MessageFns, protobufPackage, protobufFileName } from "./gen/compactd/v1/sessions.js";
