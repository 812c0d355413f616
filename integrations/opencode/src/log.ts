// Log lines go to OpenCode's own log (service "compactd", visible with --print-logs and in
// OpenCode's log files) and, when `logFile` is set, to that file.
import { appendFileSync } from "node:fs"

type Level = "debug" | "info" | "warn" | "error"

export interface Log {
  debug(msg: string): void
  info(msg: string): void
  warn(msg: string): void
  error(msg: string): void
}

/* eslint-disable @typescript-eslint/no-explicit-any */
export function createLog(client: any, file: string | undefined, debug: boolean): Log {
  const write = (level: Level, message: string) => {
    if (level === "debug" && !debug) return
    if (file) {
      try {
        appendFileSync(file, `${new Date().toISOString()} ${level.toUpperCase()} ${message}\n`)
      } catch {
        // a log that cannot be written must not break the session
      }
    }
    try {
      const p = client?.app?.log?.({ body: { service: "compactd", level, message } })
      if (p && typeof p.catch === "function") p.catch(() => undefined)
    } catch {
      // same
    }
  }
  return {
    debug: (m) => write("debug", m),
    info: (m) => write("info", m),
    warn: (m) => write("warn", m),
    error: (m) => write("error", m),
  }
}
