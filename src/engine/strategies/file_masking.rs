//! Strategy 7, `pruneFiles`: attachments older than 2 user turns become breadcrumbs,
//! `[File: name, NKB]` (no cache: the agent reads the file again if it needs it). Covers
//! `file` parts carrying data, and the synthetic text parts in which OpenCode inlines an
//! attached file's content (`<path>…</path><type>file</type><content>…`).

use crate::domain::{FilePart, TextPart};

/// Synthetic text shorter than this is a note about an attachment, not its content.
const MIN_INLINED_CHARS: usize = 1024;

/// True for attachments OpenCode inlines as synthetic text instead of sending the file
/// (text files, directories): their file part never reaches the model.
pub fn is_inlined_file(mime: &str) -> bool {
    mime == "text/plain" || mime == "application/x-directory"
}

/// The breadcrumb a file reads as.
pub fn breadcrumb(name: &str, bytes: usize) -> String {
    format!("[File: {name}, {}KB]", bytes.saturating_add(512) / 1024)
}

/// The breadcrumb for a `file` part.
pub fn file_breadcrumb(f: &FilePart) -> String {
    let name = if f.filename.is_empty() {
        f.url.rsplit('/').next().unwrap_or("file")
    } else {
        f.filename.as_str()
    };
    let bytes = if f.size > 0 {
        usize::try_from(f.size).unwrap_or(usize::MAX)
    } else {
        payload_bytes(&f.url)
    };
    breadcrumb(name, bytes)
}

/// The breadcrumb for a synthetic text part holding an attached file's content, or
/// `None` when the text is not one.
pub fn inlined_breadcrumb(t: &TextPart) -> Option<String> {
    if !t.synthetic || t.text.len() < MIN_INLINED_CHARS {
        return None;
    }
    let name = t
        .text
        .strip_prefix("<path>")
        .and_then(|rest| rest.split_once("</path>"))
        .map(|(path, _)| path.trim())
        .filter(|p| !p.is_empty())
        .unwrap_or("attachment");
    Some(breadcrumb(name, t.text.len()))
}

/// Bytes a URL carries: the decoded payload of a `data:` URL, else nothing.
fn payload_bytes(url: &str) -> usize {
    let Some(rest) = url.strip_prefix("data:") else {
        return 0;
    };
    let Some((meta, data)) = rest.split_once(',') else {
        return 0;
    };
    if meta.ends_with(";base64") {
        data.len() / 4 * 3
    } else {
        data.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_files_report_their_decoded_size() {
        let f = FilePart {
            mime: "image/png".into(),
            filename: "shot.png".into(),
            url: format!("data:image/png;base64,{}", "A".repeat(40_960)),
            ..Default::default()
        };
        assert_eq!(file_breadcrumb(&f), "[File: shot.png, 30KB]");
    }

    #[test]
    fn inlined_attachments_are_recognised_by_their_shape() {
        let content = TextPart {
            text: format!(
                "<path>/repo/AGENTS.md</path>\n<type>file</type>\n<content>{}",
                "x".repeat(3000)
            ),
            synthetic: true,
            ..Default::default()
        };
        assert_eq!(
            inlined_breadcrumb(&content).as_deref(),
            Some("[File: /repo/AGENTS.md, 3KB]")
        );
        let user_text = TextPart {
            synthetic: false,
            ..content.clone()
        };
        assert_eq!(inlined_breadcrumb(&user_text), None);
        let note = TextPart {
            text: "Called the Read tool with the following input: {}".into(),
            synthetic: true,
            ..Default::default()
        };
        assert_eq!(inlined_breadcrumb(&note), None);
    }
}

#[cfg(test)]
mod overflow_tests {
    use super::*;

    #[test]
    fn an_absurd_client_size_does_not_overflow() {
        let f = FilePart {
            filename: "x.bin".into(),
            size: u64::MAX,
            ..Default::default()
        };
        assert!(file_breadcrumb(&f).starts_with("[File: x.bin, "));
    }
}
