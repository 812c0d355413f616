//! Base layer, `supersedeTodos`: the todo list is one piece of state; only the newest
//! `todowrite`/`todoread` result stays. Todo tools are protected from age and size
//! pruning, but a newer version of the same state still supersedes an older one.

use super::tool_is;

/// The supersede key of a todo call (`None`: not one).
pub fn todo_key(tool: &str) -> Option<String> {
    tool_is(tool, &["todowrite", "todoread", "todo_write", "todo_read"]).then(|| "todo".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_todo_tools_share_one_key() {
        assert_eq!(todo_key("todowrite"), todo_key("TodoRead"));
        assert!(todo_key("todowrite").is_some());
        assert!(todo_key("task").is_none());
    }
}
