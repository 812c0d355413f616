import type { DeepPartial } from "./gen/compactd/v1/sessions.js";

/** A JSON value, as carried in `google.protobuf.Struct` fields (tool inputs, `extra`, OpenAI messages). */
export type JsonValue = null | boolean | number | string | JsonValue[] | { [key: string]: JsonValue };

/** One OpenAI chat-completions message, as compactd renders the context (`Context.openaiMessages`). */
export interface OpenAIChatMessage {
  role: "system" | "user" | "assistant" | "tool" | (string & {});
  content?: string | null | Array<{ type: string; [key: string]: unknown }>;
  tool_calls?: Array<{
    id: string;
    type: "function";
    function: { name: string; arguments: string };
  }>;
  tool_call_id?: string;
  name?: string;
  [key: string]: unknown;
}

/** An OpenAI function-calling tool definition (`tools` entry of a chat-completions request). */
export interface OpenAITool {
  type: "function";
  function: {
    name: string;
    description?: string;
    parameters?: { [key: string]: unknown };
  };
}

/** Per-call options of every RPC. */
export interface CallOptions {
  /**
   * Deadline of this call in milliseconds (unary default: the client's `deadlineMs`;
   * streams: none). 0 or less is a deadline already past: the call fails DEADLINE_EXCEEDED
   * at once (a remaining budget that ran out). `null` (or `Infinity`): no deadline, the
   * client's default for unary calls included.
   */
  deadlineMs?: number | null;
  /**
   * Cancels the call (a unary call then rejects with CANCELLED; a stream ends; a `compact()`
   * run ends with `failed` of kind "cancelled" unless its outcome arrived first).
   */
  signal?: AbortSignal;
}

export type { DeepPartial };
