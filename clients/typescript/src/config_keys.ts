import { status as Status } from "@grpc/grpc-js";
import { CompactdError } from "./errors.js";
import { SessionConfig } from "./gen/compactd/v1/session.js";

/** SessionConfig's fields, as this client spells them (camelCase). */
const KNOWN: ReadonlySet<string> = new Set(Object.keys(SessionConfig.create()));

const camel = (k: string) => k.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase());

/**
 * Throws a CompactdError INVALID_ARGUMENT naming the first key of `config` that SessionConfig
 * does not have (`where` prefixes it, e.g. "session.config.treshold"), before anything is sent:
 * the generated code would drop it, and a mistyped setting would silently keep its default
 * (the Python client raises for the same). A snake_case spelling of a field is named with its
 * camelCase one.
 */
export function checkSessionConfig(config: unknown, where = "config"): void {
  if (config === undefined || config === null) return;
  if (typeof config !== "object" || Array.isArray(config)) {
    throw new CompactdError({ code: Status.INVALID_ARGUMENT, field: where, details: `${where} must be an object of SessionConfig fields` });
  }
  for (const key of Object.keys(config)) {
    if (KNOWN.has(key)) continue;
    const hint = KNOWN.has(camel(key)) ? ` (write it ${camel(key)})` : "";
    throw new CompactdError({
      code: Status.INVALID_ARGUMENT,
      field: `${where}.${key}`,
      details: `${where} has no field ${JSON.stringify(key)}${hint}; its fields are ${[...KNOWN].join(", ")}`,
    });
  }
}
