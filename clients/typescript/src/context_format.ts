import { ContextFormat, type Context } from "./gen/compactd/v1/sessions.js";
import type { OpenAIChatMessage } from "./types.js";

/**
 * The shapes a context can be asked for: "both" (default), "openai" (only `openaiMessages`),
 * "openai_json" (only `openaiMessagesJson`, the same messages as one JSON text) or "native"
 * (only `messages`). One name for the unary call and the stream alike.
 */
export type ContextFormatName = "both" | "openai" | "openai_json" | "native";

/** The request's `ContextFormat` for a {@link ContextFormatName}. */
export function contextFormat(format: ContextFormatName): ContextFormat {
  switch (format) {
    case "openai":
      return ContextFormat.CONTEXT_FORMAT_OPENAI;
    case "openai_json":
      return ContextFormat.CONTEXT_FORMAT_OPENAI_JSON;
    case "native":
      return ContextFormat.CONTEXT_FORMAT_NATIVE;
    default:
      return ContextFormat.CONTEXT_FORMAT_UNSPECIFIED;
  }
}

/** The OpenAI chat `messages` of a context fetched as "openai_json" (none when empty). */
export function openaiMessagesOf(ctx: Context): OpenAIChatMessage[] {
  return ctx.openaiMessagesJson ? (JSON.parse(ctx.openaiMessagesJson) as OpenAIChatMessage[]) : [];
}
