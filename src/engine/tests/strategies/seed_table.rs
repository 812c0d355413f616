//! t35–t45: one test per row of seed 03's test table.

use super::*;

#[test]
fn t35_input_leak_superseded_write_keeps_only_its_path() {
    let content = "A".repeat(5000);
    let write_input = json!({ "filePath": "test.txt", "content": content });
    let mut sc = Script::new();
    sc.user("u1", "Create test.txt, then check it.").assistant(
        "a1",
        vec![
            call(
                "a1",
                "w1",
                "write",
                write_input.clone(),
                "Wrote file successfully.",
            ),
            read("a1", "r1", "test.txt", &content),
        ],
    );
    let run = sc.commit();

    expect_marks(&sc.s, &[("w1", St::AggressiveFilePrune, "r1")]);
    let w1 = shown(&run.after, "w1");
    assert_eq!(state(w1).input, json!({ "filePath": "test.txt" }));
    // The note would be longer than the write's own short output, which stays.
    assert_eq!(state(w1).output, "Wrote file successfully.");
    assert_eq!(
        state(&find(&sc.s, "w1")).input,
        write_input,
        "original kept"
    );
    assert_eq!(
        tool_result(&run.after.to_openai(), "call_w1"),
        "Wrote file successfully."
    );

    // Accounting: the output stays as it was, so the file strategy's own saving is 0 and
    // the input-leak fix has all of it.
    let old = count(&write_input.to_string()) + count("Wrote file successfully.");
    let new =
        count(&json!({ "filePath": "test.txt" }).to_string()) + count("Wrote file successfully.");
    assert_eq!(saving(&run.report, St::AggressiveFilePrune), Some((1, 0)));
    assert_eq!(
        saving(&run.report, St::PruneToolInputs),
        Some((1, old - new))
    );
    assert!(old - new > 1200, "the 5000-char content left the context");
    assert_eq!(run.before.tokens - run.after.tokens, old - new);
}

#[test]
fn t35_input_leak_without_the_fix_a_write_is_not_worth_superseding() {
    let content = "A".repeat(5000);
    let write_input = json!({ "filePath": "test.txt", "content": content });
    let mut sc = Script::with(switches(&[("prune_tool_inputs", false)]));
    sc.user("u1", "Create test.txt, then check it.").assistant(
        "a1",
        vec![
            call(
                "a1",
                "w1",
                "write",
                write_input.clone(),
                "Wrote file successfully.",
            ),
            read("a1", "r1", "test.txt", &content),
        ],
    );
    let run = sc.commit();
    // The note alone is longer than the write's output: a rewrite that does not shrink
    // the part is not applied, and the input keeps its content.
    expect_marks(&sc.s, &[]);
    assert_eq!(state(shown(&run.after, "w1")).input, write_input);
    assert!(run.report.strategies.is_empty());
}

#[test]
fn t35_input_leak_a_call_cleared_by_prune_keeps_only_its_path() {
    let write_input = json!({ "filePath": "notes.md", "content": "B".repeat(4000) });
    let mut sc = Script::with(SessionOverrides {
        prune_protect: Some(0),
        prune_minimum: Some(0),
        ..Default::default()
    });
    sc.user("u1", "Write the notes.")
        .assistant(
            "a1",
            vec![call(
                "a1",
                "w1",
                "write",
                write_input.clone(),
                "Wrote file successfully.",
            )],
        )
        .user("u2", "ok")
        .user("u3", "ok");
    let run = sc.commit();
    assert!(run.report.committed);
    assert_eq!(part_ids(&run.report), ["w1"]);
    let w1 = shown(&run.after, "w1");
    assert_eq!(state(w1).output, PLACEHOLDER);
    assert_eq!(state(w1).input, json!({ "filePath": "notes.md" }));
    let stripped =
        count(&write_input.to_string()) - count(&json!({ "filePath": "notes.md" }).to_string());
    assert_eq!(
        saving(&run.report, St::PruneToolInputs),
        Some((1, stripped))
    );
    expect_no_marks(&sc.s);
}

#[test]
fn prune_counts_only_what_is_left_of_an_output_a_strategy_already_shortened() {
    let mut sc = Script::with(SessionOverrides {
        prune_protect: Some(0),
        prune_minimum: Some(0),
        ..Default::default()
    });
    let (old, new) = (file_body(8_000), file_body(6_000));
    sc.user("u1", "Read it twice.")
        .assistant("a1", vec![read("a1", "r1", "src/lib.rs", &old)])
        .assistant("a2", vec![read("a2", "r2", "src/lib.rs", &new)])
        .user("u2", "ok")
        .user("u3", "ok");
    let run = sc.commit();
    assert!(run.report.committed);
    assert_eq!(part_ids(&run.report), ["r1", "r2"]);
    // The seed's figure weighs both outputs in full...
    assert_eq!(run.report.tokens_saved, count(&old) + count(&new));
    // ...but r1 was already down to its supersede note: prune's own saving is r2's output
    // giving way to the placeholder, and with the strategies' it is the whole change.
    assert_eq!(
        run.report.context_tokens_saved,
        (count(&new) - count(PLACEHOLDER)) as i64
    );
    assert_eq!(
        run.before.tokens - run.after.tokens,
        run.report.context_tokens_saved as u64 + run.report.strategies.tokens()
    );
}

#[test]
fn t36_one_file_one_view_any_operation_supersedes_all_earlier_ones() {
    let v1 = file_body(60);
    let mut sc = Script::new();
    sc.user("u1", "Look at the config.")
        .assistant("a1", vec![read("a1", "r1", "src/config.json", &v1)])
        .user("u2", "Again?")
        .assistant("a2", vec![read("a2", "r2", "./src/config.json", &v1)])
        .user("u3", "Rewrite it.")
        .assistant(
            "a3",
            vec![call(
                "a3",
                "w1",
                "write",
                json!({ "filePath": "src/config.json", "content": file_body(50) }),
                "Wrote file successfully.",
            )],
        )
        .user("u4", "Fix one value.")
        .assistant(
            "a4",
            vec![call(
                "a4",
                "e1",
                "edit",
                json!({ "filePath": "src//config.json", "oldString": "x".repeat(300),
                    "newString": "y".repeat(300) }),
                "Edit applied successfully.",
            )],
        )
        .user("u5", "Show me.")
        .assistant(
            "a5",
            vec![
                read("a5", "r3", "src/config.json", &file_body(55)),
                read("a5", "o1", "src/other.json", &file_body(20)),
            ],
        );
    let run = sc.commit();

    // read → read → write → edit → read: only the last view stays; normalized paths
    // (`./src/…`, `src//…`) are the same file; another file is untouched. A supersede may
    // touch the last two user turns (e1 is in turn u4): it is about staleness.
    expect_marks(
        &sc.s,
        &[
            ("r1", St::AggressiveFilePrune, "r2"),
            ("r2", St::AggressiveFilePrune, "w1"),
            ("w1", St::AggressiveFilePrune, "e1"),
            ("e1", St::AggressiveFilePrune, "r3"),
        ],
    );
    for (id, by) in [("r1", "r2"), ("r2", "w1"), ("w1", "e1"), ("e1", "r3")] {
        // The note replaces an output only when it is shorter.
        let note = superseded_text(&format!("call_{by}"));
        let original = state(&find(&sc.s, id)).output.clone();
        let expected = if note.len() < original.len() {
            note
        } else {
            original
        };
        assert_eq!(state(shown(&run.after, id)).output, expected, "{id}");
    }
    assert_eq!(state(shown(&run.after, "r3")).output, file_body(55));
    assert_eq!(state(shown(&run.after, "o1")).output, file_body(20));
    assert_eq!(
        state(shown(&run.after, "e1")).input,
        json!({ "filePath": "src//config.json" })
    );
    assert_eq!(state(&find(&sc.s, "r1")).output, v1, "original kept");
    expect_saving(&run.report, St::AggressiveFilePrune, 4);
    // Only the write and the edit had inputs worth stripping.
    expect_saving(&run.report, St::PruneToolInputs, 2);
    assert_eq!(
        saved_by(&run.report),
        [St::PruneToolInputs, St::AggressiveFilePrune]
    );
}

#[test]
fn t36_one_file_one_view_a_patch_goes_once_all_its_files_have_newer_views() {
    let patch = "*** Begin Patch\n*** Update File: src/a.rs\n@@\n-old\n+new\n*** Update File: src/b.rs\n@@\n-old\n+new\n*** End Patch";
    let mut sc = Script::new();
    sc.user("u1", "Patch both.").assistant(
        "a1",
        vec![
            call(
                "a1",
                "p1",
                "apply_patch",
                json!({ "patchText": patch }),
                &"Success. Updated the following files:\nM src/a.rs\nM src/b.rs\n".repeat(4),
            ),
            read("a1", "ra", "src/a.rs", &file_body(30)),
        ],
    );
    sc.commit();
    // src/b.rs has no newer view yet: the patch stays.
    expect_no_marks(&sc.s);

    sc.assistant("a2", vec![read("a2", "rb", "src/b.rs", &file_body(30))]);
    let run = sc.commit();
    expect_marks(&sc.s, &[("p1", St::AggressiveFilePrune, "rb")]);
    expect_saving(&run.report, St::AggressiveFilePrune, 1);
}

#[test]
fn t37_step_markers_are_filtered_from_the_context() {
    let build = |o: SessionOverrides| {
        let mut sc = Script::with(o);
        sc.user("u1", "Where is main?").assistant(
            "a1",
            vec![
                step_start("a1", "s1"),
                text("a1", "x1", "Let me look."),
                read("a1", "r1", "src/main.rs", &file_body(10)),
                step_finish("a1", "f1"),
                step_start("a1", "s2"),
                text("a1", "x2", "It is in src/main.rs."),
                step_finish("a1", "f2"),
            ],
        );
        sc
    };
    let mut on = build(SessionOverrides::default());
    let run = on.commit();
    let types = |v: &ContextView| -> Vec<&'static str> {
        v.messages[1]
            .parts
            .iter()
            .map(|p| p.part.kind.type_name())
            .collect()
    };
    assert_eq!(types(&run.after), ["text", "tool", "text"]);
    assert_eq!(on.s.messages()[1].parts.len(), 7, "markers are kept");
    // A rendering rule: nothing is marked, and markers weigh nothing in the estimate.
    expect_no_marks(&on.s);
    assert!(run.report.strategies.is_empty());

    let mut off = build(switches(&[("pruneStepMarkers", false)]));
    let off_run = off.commit();
    assert_eq!(
        types(&off_run.after),
        [
            "step-start",
            "text",
            "tool",
            "step-finish",
            "step-start",
            "text",
            "step-finish"
        ]
    );
    // The OpenAI rendering finds the step boundary (text after a call) without them.
    assert_eq!(run.after.to_openai(), off_run.after.to_openai());
    assert_eq!(
        run.after.to_openai().as_array().map(Vec::len),
        Some(4),
        "user, assistant+call, tool, assistant"
    );

    // A message holding nothing but markers is not sent at all.
    on.assistant("a2", vec![step_start("a2", "s3"), step_finish("a2", "f3")]);
    let view = on.s.build_context();
    assert!(view.messages.iter().all(|m| m.info.id != "a2"));
}

#[test]
fn t38_source_url_newest_fetch_of_a_url_or_search_stays() {
    let page = "# tokio\n".to_string() + &"Docs line.\n".repeat(200);
    let hits = "1. tokio::select! cancellation safety\n".repeat(20);
    let mut sc = Script::new();
    sc.user("u1", "Read the tokio docs.")
        .assistant(
            "a1",
            vec![
                call(
                    "a1",
                    "f1",
                    "webfetch",
                    json!({ "url": "https://docs.rs/tokio/latest/tokio/", "format": "markdown" }),
                    &page,
                ),
                call(
                    "a1",
                    "q1",
                    "websearch",
                    json!({ "query": "tokio select cancel safety" }),
                    &hits,
                ),
            ],
        )
        .user("u2", "And again.")
        .assistant(
            "a2",
            vec![
                call(
                    "a2",
                    "f2",
                    "webfetch",
                    json!({ "url": "https://docs.rs/tokio/latest/tokio/#modules",
                        "format": "markdown" }),
                    &page,
                ),
                call(
                    "a2",
                    "g1",
                    "webfetch",
                    json!({ "url": "https://example.com/other", "format": "markdown" }),
                    &page,
                ),
                call(
                    "a2",
                    "q2",
                    "websearch",
                    json!({ "query": "tokio select cancel safety" }),
                    &hits,
                ),
            ],
        );
    let run = sc.commit();
    // The fragment never reaches the server: same document.
    expect_marks(
        &sc.s,
        &[
            ("f1", St::PruneSourceUrls, "f2"),
            ("q1", St::PruneSourceUrls, "q2"),
        ],
    );
    assert_eq!(
        state(shown(&run.after, "f1")).output,
        superseded_text("call_f2")
    );
    assert_eq!(state(shown(&run.after, "g1")).output, page);
    assert_eq!(state(&find(&sc.s, "f1")).output, page);
    expect_saving(&run.report, St::PruneSourceUrls, 2);
    assert_eq!(saved_by(&run.report), [St::PruneSourceUrls]);
}

#[test]
fn t39_state_query_only_the_newest_ls_or_git_status_stays() {
    let listing = "drwxr-xr-x  5 dev dev 4096 Jan  1 00:00 src\n".repeat(30);
    let status = "On branch main\nChanges not staged for commit:\n".to_string()
        + &"\tmodified:   src/lib.rs\n".repeat(20);
    let mut sc = Script::new();
    sc.user("u1", "What is the state?")
        .assistant(
            "a1",
            vec![
                call(
                    "a1",
                    "l1",
                    "bash",
                    json!({ "command": "ls -la", "description": "List files" }),
                    &listing,
                ),
                bash("a1", "g1", "git status", &status),
                bash("a1", "c1", "cargo build", &"Compiling x\n".repeat(30)),
                bash(
                    "a1",
                    "n1",
                    "find . -name '*.rs'",
                    &"./src/lib.rs\n".repeat(30),
                ),
            ],
        )
        .user("u2", "And now?")
        .assistant(
            "a2",
            vec![
                call(
                    "a2",
                    "l2",
                    "bash",
                    json!({ "command": "ls -la", "description": "List files again" }),
                    &listing,
                ),
                bash("a2", "g2", "  git   status ", &status),
                bash("a2", "l3", "ls", &"src\n".repeat(30)),
                bash(
                    "a2",
                    "c2",
                    "cargo build --release",
                    &"Compiling x\n".repeat(30),
                ),
                bash(
                    "a2",
                    "n2",
                    "find . -name '*.rs'",
                    &"./src/lib.rs\n".repeat(30),
                ),
            ],
        );
    let run = sc.commit();
    // `ls` and `ls -la` are different queries; builds are not queries; whitespace in the
    // command does not matter; an identical `find` is a state query before a duplicate.
    expect_marks(
        &sc.s,
        &[
            ("l1", St::StateQuerySupersede, "l2"),
            ("g1", St::StateQuerySupersede, "g2"),
            ("n1", St::StateQuerySupersede, "n2"),
        ],
    );
    assert_eq!(
        state(shown(&run.after, "g1")).output,
        superseded_text("call_g2")
    );
    assert_eq!(
        state(shown(&run.after, "c1")).output,
        "Compiling x\n".repeat(30)
    );
    expect_saving(&run.report, St::StateQuerySupersede, 3);
    assert_eq!(saved_by(&run.report), [St::StateQuerySupersede]);
}

#[test]
fn t40_snapshot_only_the_latest_snapshot_is_retained() {
    let tree = "- button \"Submit\" [ref=e12]\n".repeat(80);
    let mut sc = Script::new();
    sc.user("u1", "Check the page.")
        .assistant(
            "a1",
            vec![
                call("a1", "s1", "playwright_browser_snapshot", json!({}), &tree),
                call("a1", "s2", "browser_snapshot", json!({}), &tree),
            ],
        )
        .user("u2", "Click submit and check again.")
        .assistant(
            "a2",
            vec![call(
                "a2",
                "s3",
                "playwright_browser_snapshot",
                json!({}),
                &tree,
            )],
        );
    let run = sc.commit();
    expect_marks(
        &sc.s,
        &[
            ("s1", St::PruneSnapshots, "s2"),
            ("s2", St::PruneSnapshots, "s3"),
        ],
    );
    assert_eq!(
        state(shown(&run.after, "s2")).output,
        superseded_text("call_s3")
    );
    assert_eq!(state(shown(&run.after, "s3")).output, tree);
    expect_saving(&run.report, St::PruneSnapshots, 2);

    // Which tools are snapshots is configurable.
    let mut custom = Script::with(SessionOverrides {
        snapshot_tools: Some(vec!["capture_state".into()]),
        ..Default::default()
    });
    custom.user("u1", "Capture.").assistant(
        "a1",
        vec![
            call("a1", "b1", "browser_snapshot", json!({ "tab": 1 }), &tree),
            call("a1", "c1", "capture_state", json!({ "tab": 1 }), &tree),
            call("a1", "b2", "browser_snapshot", json!({ "tab": 2 }), &tree),
            call("a1", "c2", "mcp_capture_state", json!({ "tab": 2 }), &tree),
        ],
    );
    custom.commit();
    expect_marks(&custom.s, &[("c1", St::PruneSnapshots, "c2")]);
}

#[test]
fn t41_retry_failed_attempt_pruned_on_success() {
    let err = |what: &str| {
        format!("error[E0425]: {what}\n") + &" --> src/main.rs:3:5\n  |\n3 |     x\n".repeat(12)
    };
    let ok = "test result: ok. 42 passed; 0 failed\n".repeat(5);
    let mut sc = Script::new();
    sc.user("u1", "Run the tests.")
        .assistant(
            "a1",
            vec![
                failed(
                    "a1",
                    "e1",
                    "bash",
                    json!({ "command": "cargo test", "timeout": 60000 }),
                    &err("cannot find value `x`"),
                ),
                call(
                    "a1",
                    "k1",
                    "bash",
                    json!({ "timeout": 60000, "command": "cargo test" }),
                    &ok,
                ),
                failed(
                    "a1",
                    "e2",
                    "bash",
                    json!({ "command": "npm test" }),
                    &err("npm"),
                ),
                bash("a1", "k2", "npm test -- --watch=false", &ok),
            ],
        )
        .user("u2", "Lint too.")
        .assistant(
            "a2",
            vec![
                failed(
                    "a2",
                    "e3",
                    "bash",
                    json!({ "command": "cargo clippy" }),
                    &err("a"),
                ),
                failed(
                    "a2",
                    "e4",
                    "bash",
                    json!({ "command": "cargo clippy" }),
                    &err("b"),
                ),
                bash("a2", "k3", "cargo clippy", &ok),
                bash("a2", "k4", "make", &ok),
                failed(
                    "a2",
                    "e5",
                    "bash",
                    json!({ "command": "make" }),
                    &err("make"),
                ),
            ],
        );
    let run = sc.commit();
    // Same tool + canonical input (key order does not matter); a different input is not a
    // retry; every failure before the success goes; a failure after a success stays.
    expect_marks(
        &sc.s,
        &[
            ("e1", St::PruneRetryParts, "k1"),
            ("e3", St::PruneRetryParts, "k3"),
            ("e4", St::PruneRetryParts, "k3"),
        ],
    );
    let e1 = shown(&run.after, "e1");
    assert_eq!(state(e1).status, ToolStatus::Error);
    assert_eq!(state(e1).error, superseded_text("call_k1"));
    assert_eq!(
        tool_result(&run.after.to_openai(), "call_e1"),
        superseded_text("call_k1")
    );
    assert_eq!(state(shown(&run.after, "e2")).error, err("npm"));
    assert_eq!(state(shown(&run.after, "e5")).error, err("make"));
    assert_eq!(
        state(&find(&sc.s, "e1")).error,
        err("cannot find value `x`")
    );
    expect_saving(&run.report, St::PruneRetryParts, 3);
    assert_eq!(saved_by(&run.report), [St::PruneRetryParts]);
}

#[test]
fn t42_file_masking_attachments_are_masked_with_breadcrumbs() {
    let inlined = format!(
        "<path>/repo/AGENTS.md</path>\n<type>file</type>\n<content>{}",
        "x".repeat(3000)
    );
    let mut sc = Script::new();
    sc.user_with(
        "u1",
        "What is wrong in this screenshot?",
        vec![
            synthetic("u1", "i1", &inlined),
            file("u1", "f1", "shot.png", "image/png", &png(40_960)),
        ],
    )
    .assistant("a1", vec![text("a1", "x1", "A layout bug.")])
    .user("u2", "Thanks.")
    .assistant("a2", vec![text("a2", "x2", "Welcome.")]);
    let run = sc.commit();
    // One user turn newer: still in the last two turns.
    expect_no_marks(&sc.s);
    assert!(run.report.strategies.is_empty());

    sc.user_with(
        "u3",
        "Another one.",
        vec![file("u3", "f3", "shot2.png", "image/png", &png(40_960))],
    )
    .assistant("a3", vec![text("a3", "x3", "Same bug.")]);
    let run = sc.commit();
    expect_marks(
        &sc.s,
        &[("f1", St::PruneFiles, ""), ("i1", St::PruneFiles, "")],
    );
    assert_eq!(shown_text(&run.after, "f1"), "[File: shot.png, 30KB]");
    assert_eq!(shown_text(&run.after, "i1"), "[File: /repo/AGENTS.md, 3KB]");
    assert!(
        matches!(&find(&sc.s, "f1").kind, PartKind::File(f) if f.url == png(40_960)),
        "original kept"
    );
    let openai = run.after.to_openai();
    assert_eq!(
        openai[0]["content"],
        json!([
            {"type": "text", "text": "What is wrong in this screenshot?"},
            {"type": "text", "text": "[File: /repo/AGENTS.md, 3KB]"},
            {"type": "text", "text": "[File: shot.png, 30KB]"},
        ])
    );
    // The attachment of the newest turn is still sent as an image.
    assert!(openai.to_string().contains("image_url"));
    expect_saving(&run.report, St::PruneFiles, 2);
    assert_eq!(saved_by(&run.report), [St::PruneFiles]);
}

#[test]

fn t42_file_masking_a_text_attachment_adds_nothing_to_the_payload() {
    // OpenCode sends a text attachment as its synthetic text, never the file part itself
    // (`to_openai` skips text/plain file parts). Masking the file part would turn it into
    // a synthetic text part that is sent: the payload would grow while the estimate
    // shrank. (Found by this test; fixed.)
    let body = "line of notes\n".repeat(300);
    let mut sc = Script::new();
    sc.user_with(
        "u1",
        "Read my notes.",
        vec![file(
            "u1",
            "f1",
            "notes.txt",
            "text/plain",
            &format!("data:text/plain,{body}"),
        )],
    )
    .user("u2", "ok")
    .user("u3", "ok");
    let before = sc.s.build_context().to_openai();
    let run = sc.commit();
    // Its content travels as synthetic text (masked on its own); the part is left alone.
    expect_marks(&sc.s, &[]);
    let after = run.after.to_openai();
    assert!(
        after.to_string().len() <= before.to_string().len(),
        "payload grew: {} -> {}",
        before[0],
        after[0]
    );
}

#[test]
fn t43_user_code_old_code_blocks_are_truncated() {
    let asked = format!(
        "Why does this fail?\n```rust\n{}```\nthanks",
        "let x = compute(1);\n".repeat(15)
    );
    let mut sc = Script::new();
    sc.user("u1", &asked).assistant(
        "a1",
        vec![text(
            "a1",
            "x1",
            &format!("Try:\n```rust\n{}```", "let y = 2;\n".repeat(15)),
        )],
    );
    // A synthetic user text (a host note) is not the user's code.
    put(
        &mut sc.s,
        Update::UpsertPart(synthetic(
            "u1",
            "y1",
            &format!("```text\n{}```", "tool note\n".repeat(15)),
        )),
    );
    for n in 2..=5 {
        sc.user(&format!("u{n}"), "next");
        sc.commit();
    }
    // Four user turns newer: not yet.
    expect_no_marks(&sc.s);

    sc.user("u6", "next");
    let run = sc.commit();
    expect_marks(&sc.s, &[("u1_t", St::PruneUserCodeBlocks, "")]);
    assert_eq!(
        shown_text(&run.after, "u1_t"),
        "Why does this fail?\n[Code block: rust, 15 lines - truncated to save context]\nthanks"
    );
    assert!(
        shown_text(&run.after, "x1").contains("let y = 2;"),
        "assistant text kept"
    );
    assert!(matches!(&find(&sc.s, "u1_t").kind, PartKind::Text(t) if t.text == asked));
    expect_saving(&run.report, St::PruneUserCodeBlocks, 1);
    assert_eq!(saved_by(&run.report), [St::PruneUserCodeBlocks]);
}

#[test]
fn t44_error_truncation_old_errors_keep_their_first_line() {
    let error = stack_error("Error: Something failed", 20);
    let mut sc = Script::new();
    sc.user("u1", "Build it.").assistant(
        "a1",
        vec![
            failed(
                "a1",
                "e1",
                "bash",
                json!({ "command": "npm run build" }),
                &error,
            ),
            failed(
                "a1",
                "e2",
                "read",
                json!({ "filePath": "missing.txt" }),
                "Error: file not found",
            ),
        ],
    );
    for n in 2..=3 {
        sc.user(&format!("u{n}"), "next");
        sc.commit();
    }
    // Two user turns newer: not yet.
    expect_no_marks(&sc.s);

    sc.user("u4", "next");
    let run = sc.commit();
    // A one-line error would not get shorter.
    expect_marks(&sc.s, &[("e1", St::TruncateOldErrors, "")]);
    let e1 = shown(&run.after, "e1");
    assert_eq!(
        state(e1).error,
        format!(
            "Error: Something failed\n[Error output truncated - {} chars total]",
            error.chars().count()
        )
    );
    // Not a supersede: the input stays as it was.
    assert_eq!(state(e1).input, json!({ "command": "npm run build" }));
    assert_eq!(state(&find(&sc.s, "e1")).error, error);
    expect_saving(&run.report, St::TruncateOldErrors, 1);
    assert_eq!(saved_by(&run.report), [St::TruncateOldErrors]);
}

#[test]
fn t45_compaction_awareness_compacted_outputs_are_not_processed_twice() {
    // An output the host already compacted is not superseded again.
    let body = file_body(80);
    let mut compacted = read("a1", "r1", "src/a.rs", &body);
    state_mut(&mut compacted).time.compacted = Some(NOW - 1_000);
    let mut sc = Script::new();
    sc.user("u1", "Read a.rs.")
        .assistant("a1", vec![compacted])
        .user("u2", "Again.")
        .assistant("a2", vec![read("a2", "r2", "src/a.rs", &body)]);
    let run = sc.commit();
    expect_no_marks(&sc.s);
    assert!(run.report.strategies.is_empty());
    assert_eq!(state(shown(&run.after, "r1")).output, PLACEHOLDER);
    assert_eq!(run.before, run.after);
}

#[test]
fn t45_compaction_awareness_prune_after_a_strategy_keeps_the_strategy_reading() {
    let body = file_body(200);
    let mut sc = Script::with(SessionOverrides {
        prune_protect: Some(0),
        prune_minimum: Some(0),
        ..Default::default()
    });
    sc.user("u1", "Read a.rs twice.")
        .assistant(
            "a1",
            vec![
                read("a1", "r1", "src/a.rs", &body),
                read("a1", "r2", "src/a.rs", &body),
            ],
        )
        .user("u2", "ok")
        .user("u3", "ok");
    let run = sc.commit();
    // The strategies run first; prune then clears both outputs, but r1 keeps reading as
    // the strategy made it and its tokens are not removed twice.
    assert!(run.report.committed);
    assert_eq!(part_ids(&run.report), ["r1", "r2"]);
    expect_marks(&sc.s, &[("r1", St::AggressiveFilePrune, "r2")]);
    assert_eq!(
        state(shown(&run.after, "r1")).output,
        superseded_text("call_r2")
    );
    assert_eq!(state(shown(&run.after, "r2")).output, PLACEHOLDER);
    let r2_saved = part_tokens(&run.before, "r2") - part_tokens(&run.after, "r2");
    assert_eq!(
        run.before.tokens - run.after.tokens,
        run.report.strategies.tokens() + r2_saved
    );
    // A second run: both are compacted, nothing is processed again.
    let again = sc.commit();
    assert!(again.report.strategies.is_empty() && !again.report.committed);
    assert_eq!(again.before, again.after);
}

/// Found in review: a superseded output shorter than the supersede note kept reading as
/// stored once prune cleared it too (the clearing branch was never reached for a
/// superseded part); it reads as prune's placeholder, as every cleared output does.
#[test]
fn t45_compaction_awareness_a_tiny_superseded_output_cleared_by_prune_reads_cleared() {
    let write = |msg: &str, id: &str| {
        let input = json!({ "filePath": "src/a.rs", "content": "w".repeat(4_000) });
        call(msg, id, "write", input, "Wrote file successfully.")
    };
    let mut sc = Script::with(SessionOverrides {
        prune_protect: Some(0),
        prune_minimum: Some(0),
        ..Default::default()
    });
    sc.user("u1", "Write a.rs twice.")
        .assistant("a1", vec![write("a1", "w1"), write("a1", "w2")])
        .user("u2", "ok")
        .user("u3", "ok");
    // The note is longer than w1's output: the supersede strips only its input.
    assert!(superseded_text("call_w2").len() > "Wrote file successfully.".len());
    let run = sc.commit();
    assert!(run.report.committed);
    assert_eq!(part_ids(&run.report), ["w1", "w2"]);
    expect_marks(&sc.s, &[("w1", St::AggressiveFilePrune, "w2")]);
    for id in ["w1", "w2"] {
        assert_eq!(state(shown(&run.after, id)).output, PLACEHOLDER, "{id}");
        let call_id = format!("call_{id}");
        assert_eq!(tool_result(&run.after.to_openai(), &call_id), PLACEHOLDER);
    }
}

#[test]
fn t45_compaction_awareness_parts_summarized_away_are_left_alone() {
    let body = file_body(80);
    let mut sc = Script::new();
    sc.user("u1", "Read a.rs.")
        .assistant(
            "a1",
            vec![
                read("a1", "r1", "src/a.rs", &body),
                failed(
                    "a1",
                    "e1",
                    "bash",
                    json!({ "command": "cargo test" }),
                    &stack_error("boom", 20),
                ),
            ],
        )
        .user_with("u2", "", vec![compaction("u2", "c1")]);
    put(&mut sc.s, Update::UpsertMessage(summary("s1", "u2")));
    put(
        &mut sc.s,
        Update::UpsertPart(text("s1", "s1_t", "We read a.rs; cargo test failed.")),
    );
    sc.user("u3", "Go on.")
        .assistant(
            "a3",
            vec![
                read("a3", "r2", "src/a.rs", &body),
                bash("a3", "k1", "cargo test", "ok"),
            ],
        )
        .user("u4", "next")
        .user("u5", "next")
        .user("u6", "next");
    let run = sc.commit();
    // r1 and e1 are behind the compaction boundary: the summary already replaced them.
    expect_no_marks(&sc.s);
    assert!(run.report.strategies.is_empty());
    assert_eq!(run.after.boundary_message_id.as_deref(), Some("u2"));
}
