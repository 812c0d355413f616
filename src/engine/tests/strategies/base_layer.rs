//! The base supersede layer: identical calls, todo lists and searches keep only the newest.

use super::*;

#[test]
fn base_supersede_duplicates_identical_calls_keep_the_newest() {
    let rows = "| id | name |\n".repeat(60);
    let mut sc = Script::new();
    sc.user("u1", "Query the db.")
        .assistant(
            "a1",
            vec![
                call(
                    "a1",
                    "d1",
                    "db_query",
                    json!({ "sql": "select * from users", "limit": 50 }),
                    &rows,
                ),
                call(
                    "a1",
                    "d2",
                    "db_query",
                    json!({ "sql": "select * from users", "limit": 51 }),
                    &rows,
                ),
            ],
        )
        .user("u2", "Again.")
        .assistant(
            "a2",
            vec![call(
                "a2",
                "d3",
                "db_query",
                json!({ "limit": 50, "sql": "select * from users" }),
                &rows,
            )],
        );
    let run = sc.commit();
    expect_marks(&sc.s, &[("d1", St::SupersedeDuplicates, "d3")]);
    assert_eq!(
        state(shown(&run.after, "d1")).output,
        superseded_text("call_d3")
    );
    expect_saving(&run.report, St::SupersedeDuplicates, 1);
    assert_eq!(saved_by(&run.report), [St::SupersedeDuplicates]);
}

#[test]
fn base_todo_only_the_newest_todo_state_stays_even_though_protected() {
    let list1 = todos(&[
        ("Reproduce the failing test", "in_progress"),
        ("Fix the parser", "pending"),
        ("Update the changelog", "pending"),
    ]);
    let list2 = todos(&[
        ("Reproduce the failing test", "completed"),
        ("Fix the parser", "in_progress"),
        ("Update the changelog", "pending"),
    ]);
    let mut sc = Script::new();
    sc.user("u1", "Plan it.")
        .assistant(
            "a1",
            vec![call(
                "a1",
                "t1",
                "todowrite",
                list1.clone(),
                &list1["todos"].to_string(),
            )],
        )
        .user("u2", "Go.")
        .assistant(
            "a2",
            vec![
                call(
                    "a2",
                    "t2",
                    "todoread",
                    json!({}),
                    &list1["todos"].to_string(),
                ),
                call(
                    "a2",
                    "t3",
                    "todowrite",
                    list2.clone(),
                    &list2["todos"].to_string(),
                ),
            ],
        );
    let run = sc.commit();
    expect_marks(
        &sc.s,
        &[
            ("t1", St::SupersedeTodos, "t2"),
            ("t2", St::SupersedeTodos, "t3"),
        ],
    );
    assert_eq!(
        state(shown(&run.after, "t1")).output,
        superseded_text("call_t2")
    );
    assert_eq!(
        state(shown(&run.after, "t3")).output,
        list2["todos"].to_string()
    );
    expect_saving(&run.report, St::SupersedeTodos, 2);
}

#[test]
fn base_searches_glob_and_grep_keyed_by_path_pattern_and_include() {
    let hits = "src/lib.rs:10: fn main() {}\n".repeat(30);
    let mut sc = Script::new();
    sc.user("u1", "Find main.")
        .assistant(
            "a1",
            vec![
                call(
                    "a1",
                    "g1",
                    "glob",
                    json!({ "pattern": "**/*.rs", "path": "/repo/src" }),
                    &hits,
                ),
                call(
                    "a1",
                    "r1",
                    "grep",
                    json!({ "pattern": "fn main", "path": "src", "include": "*.rs" }),
                    &hits,
                ),
                call(
                    "a1",
                    "r2",
                    "grep",
                    json!({ "pattern": "fn main", "path": "src" }),
                    &hits,
                ),
            ],
        )
        .user("u2", "Again.")
        .assistant(
            "a2",
            vec![
                call(
                    "a2",
                    "g2",
                    "glob",
                    json!({ "pattern": "**/*.rs", "path": "/repo/src/" }),
                    &hits,
                ),
                call(
                    "a2",
                    "r3",
                    "grep",
                    json!({ "pattern": "fn main", "path": "./src", "include": "*.rs" }),
                    &hits,
                ),
                call(
                    "a2",
                    "g3",
                    "glob",
                    json!({ "pattern": "**/*.ts", "path": "/repo/src" }),
                    &hits,
                ),
            ],
        );
    let run = sc.commit();
    expect_marks(
        &sc.s,
        &[
            ("g1", St::SupersedeSearches, "g2"),
            ("r1", St::SupersedeSearches, "r3"),
        ],
    );
    expect_saving(&run.report, St::SupersedeSearches, 2);
    assert_eq!(saved_by(&run.report), [St::SupersedeSearches]);
}
