use compactd::config::EngineConfig;
use compactd::tokens::CharsPerToken;
use std::sync::Arc;
use std::time::Instant;
fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5000);
    let kind = std::env::args().nth(2).unwrap_or("text".into());
    let parts: Vec<serde_json::Value> = (0..n).map(|i| if kind == "tool" {
        serde_json::json!({"id": format!("p{i}"), "messageID": "m", "sessionID": "s", "type": "tool", "callID": format!("c{i}"), "tool": "read", "state": {"status": "completed", "input": {"filePath": format!("f{i}")}, "output": "x", "title": "", "metadata": {}, "time": {"start": 1, "end": 2}}})
    } else {
        serde_json::json!({"id": format!("p{i}"), "messageID": "m", "sessionID": "s", "type": "text", "text": "hello"})
    }).collect();
    let doc = serde_json::json!({"info": {"id": "s"}, "messages": [{"info": {"id": "m", "sessionID": "s", "role": "assistant", "time": {"created": 1}, "modelID": "x", "providerID": "y", "mode": "build", "path": {"cwd": "/", "root": "/"}, "cost": 0, "tokens": {"input": 0, "output": 0, "reasoning": 0, "cache": {"read": 0, "write": 0}}}, "parts": parts}]}).to_string();
    let config = EngineConfig::default();
    let t = Instant::now();
    let e = compactd::trace::parse_export(&doc).unwrap();
    let parsed = t.elapsed();
    let s = compactd::trace::load(
        e,
        Default::default(),
        Default::default(),
        &config,
        Arc::new(CharsPerToken),
    )
    .unwrap();
    println!(
        "{n} {kind} parts: parse {parsed:?} load {:?} ({} parts)",
        t.elapsed() - parsed,
        s.part_count()
    );
}
