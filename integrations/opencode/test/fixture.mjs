// Creates the throwaway git repository the scripted session works in: a tiny
// expression calculator whose parser subtracts wrong, its tests, and a build script
// that prints a long log.
import { execFileSync } from "node:child_process"
import { mkdirSync, writeFileSync, chmodSync } from "node:fs"
import { join } from "node:path"

export const LEXER = `// Turns an arithmetic expression into tokens.
export function tokenize(source) {
  const tokens = []
  let i = 0
  while (i < source.length) {
    const c = source[i]
    if (c === " " || c === "\\t") {
      i++
      continue
    }
    if (/[0-9.]/.test(c)) {
      let j = i
      while (j < source.length && /[0-9.]/.test(source[j])) j++
      tokens.push({ kind: "number", value: Number(source.slice(i, j)), pos: i })
      i = j
      continue
    }
    if ("+-*/()".includes(c)) {
      tokens.push({ kind: "op", value: c, pos: i })
      i++
      continue
    }
    throw new SyntaxError(\`unexpected character \${JSON.stringify(c)} at \${i}\`)
  }
  tokens.push({ kind: "eof", pos: source.length })
  return tokens
}
`

export const PARSER_BUG = "      left = { op: \"-\", left, right, value: left.value + right.value }"
export const PARSER_FIX = "      left = { op: \"-\", left, right, value: left.value - right.value }"

export const PARSER = `import { tokenize } from "./lexer.js"

// Recursive-descent parser for + - * / and parentheses. Every node carries its value.
export function parse(source) {
  const tokens = tokenize(source)
  let pos = 0
  const peek = () => tokens[pos]
  const next = () => tokens[pos++]

  function primary() {
    const t = next()
    if (t.kind === "number") return { op: "num", value: t.value }
    if (t.kind === "op" && t.value === "(") {
      const inner = expr()
      const close = next()
      if (close.kind !== "op" || close.value !== ")") {
        throw new SyntaxError(\`expected ) at \${close.pos}\`)
      }
      return inner
    }
    if (t.kind === "op" && t.value === "-") {
      const operand = primary()
      return { op: "neg", operand, value: -operand.value }
    }
    throw new SyntaxError(\`unexpected token at \${t.pos}\`)
  }

  function term() {
    let left = primary()
    while (peek().kind === "op" && (peek().value === "*" || peek().value === "/")) {
      const op = next().value
      const right = primary()
      if (op === "/" && right.value === 0) throw new RangeError("division by zero")
      left = { op, left, right, value: op === "*" ? left.value * right.value : left.value / right.value }
    }
    return left
  }

  function expr() {
    let left = term()
    while (peek().kind === "op" && (peek().value === "+" || peek().value === "-")) {
      const op = next().value
      const right = term()
      if (op === "+") {
        left = { op: "+", left, right, value: left.value + right.value }
        continue
      }
${PARSER_BUG}
    }
    return left
  }

  const tree = expr()
  if (peek().kind !== "eof") throw new SyntaxError(\`trailing input at \${peek().pos}\`)
  return tree
}

export function evaluate(source) {
  return parse(source).value
}
`

export const TESTS = `import { test } from "node:test"
import assert from "node:assert/strict"
import { evaluate, parse } from "../src/parser.js"

test("adds", () => assert.equal(evaluate("1 + 2"), 3))
test("subtracts", () => assert.equal(evaluate("10 - 4"), 6))
test("chains subtraction left to right", () => assert.equal(evaluate("10 - 4 - 3"), 3))
test("multiplies before adding", () => assert.equal(evaluate("2 + 3 * 4"), 14))
test("divides", () => assert.equal(evaluate("8 / 2"), 4))
test("parentheses", () => assert.equal(evaluate("(10 - 4) * 2"), 12))
test("negation", () => assert.equal(evaluate("-3 + 5"), 2))
test("division by zero", () => assert.throws(() => evaluate("1 / 0"), RangeError))
test("syntax error", () => assert.throws(() => parse("1 +"), SyntaxError))
`

// A build that compiles many modules and prints a long, mostly boring log.
export const BUILD = `#!/usr/bin/env bash
set -e
echo "tinycalc build 0.3.1 (node $(node --version))"
for i in $(seq 1 260); do
  printf '[build] compiling src/generated/module_%03d.js -> dist/module_%03d.js ... ok (%d ms, %d bytes)\\n' "$i" "$i" $(( (i * 37) % 91 + 4 )) $(( (i * 7919) % 40000 + 512 ))
  if [ $(( i % 23 )) -eq 0 ]; then
    printf '[warn]  src/generated/module_%03d.js:%d:%d unused variable "tmp_%d" (no-unused-vars)\\n' "$i" $(( i % 97 + 3 )) $(( i % 13 + 1 )) "$i"
  fi
done
echo "[build] bundling 260 modules into dist/tinycalc.js"
echo "[build] done: 260 modules, 11 warnings, 0 errors"
`

export const PACKAGE = JSON.stringify({ name: "tinycalc", version: "0.3.1", type: "module", private: true }, null, 2) + "\n"

export function createFixture(dir) {
  mkdirSync(join(dir, "src"), { recursive: true })
  mkdirSync(join(dir, "test"), { recursive: true })
  writeFileSync(join(dir, "package.json"), PACKAGE)
  writeFileSync(join(dir, "src", "lexer.js"), LEXER)
  writeFileSync(join(dir, "src", "parser.js"), PARSER)
  writeFileSync(join(dir, "test", "parser.test.js"), TESTS)
  writeFileSync(join(dir, "build.sh"), BUILD)
  chmodSync(join(dir, "build.sh"), 0o755)
  writeFileSync(join(dir, "README.md"), "# tinycalc\n\nA tiny calculator. `node --test test/` runs the tests, `bash build.sh` builds.\n")
  const git = (...args) =>
    execFileSync("git", args, {
      cwd: dir,
      stdio: "ignore",
      env: { ...process.env, GIT_AUTHOR_NAME: "t", GIT_AUTHOR_EMAIL: "t@t", GIT_COMMITTER_NAME: "t", GIT_COMMITTER_EMAIL: "t@t" },
    })
  git("init", "-q", "-b", "main")
  git("add", "-A")
  git("commit", "-q", "-m", "tinycalc")
}
