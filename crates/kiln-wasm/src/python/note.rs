//! What a one-shot's code may show, read from its source without parsing it: the note its
//! turn ends with (`#kiln:rich …`, which kiln's turn reads, `turns.py`). A one-shot with no
//! note runs as it always did: most code, `print(...)` last, pays nothing for rich results.
//!
//! The scan errs towards a note: a note that was not needed costs the guest a compile of
//! the last statement alone (or, after a `;`, a parse), and what it decides is checked
//! there by compiling; a note missed would lose a result.

/// The note a one-shot's turn ends with, words separated by spaces, or `None` where its code
/// shows nothing for certain: `at=OFFSET,LINE` (its last statement may be an expression and
/// starts at character `OFFSET`, column 0 of line `LINE`), `tree` (it may be one, after a
/// `;`: the guest parses the code to tell), `display` (the code names `display`: it is
/// defined), `plot` ([`may_plot`]: `plt.show()` shows figures, open ones come back).
pub(super) fn rich_note(code: &str) -> Option<String> {
    let mut words = Vec::new();
    match last_statement(code) {
        Last::Nothing => {}
        Last::At { offset, line } => words.push(format!("at={offset},{line}")),
        Last::Tree => words.push("tree".to_owned()),
    }
    if code.contains("display") {
        words.push("display".to_owned());
    }
    if may_plot(code) {
        words.push("plot".to_owned());
    }
    (!words.is_empty()).then(|| words.join(" "))
}

/// Whether a one-shot may leave figures open: its code names plotting (matplotlib, pyplot,
/// `plt`, `df.plot`, seaborn), or runs a program kiln does not read here (a script or a
/// module, through the launcher). Other one-shots skip watching for pyplot.
fn may_plot(code: &str) -> bool {
    ["plot", "plt", "seaborn", "__main__"]
        .iter()
        .any(|word| code.contains(word))
}

/// What the last statement of a module's source may be.
#[derive(Debug, PartialEq, Eq)]
enum Last {
    /// Nothing with a value: no statement, an indented one (the end of a block), one led by
    /// a keyword (`import`, `for`, `return`, …) or a decorator, an assignment, `print(…)`.
    Nothing,
    /// Maybe an expression, at column 0: its first character's offset (in characters, as
    /// Python indexes a string) and its line (from 1, as Python counts them).
    At { offset: usize, line: usize },
    /// Maybe an expression, after a `;` on its line.
    Tree,
}

/// Keywords that lead a statement that is not an expression.
const STATEMENT_KEYWORDS: &[&str] = &[
    "import", "from", "def", "class", "if", "elif", "else", "for", "while", "with", "try",
    "except", "finally", "return", "pass", "raise", "del", "global", "nonlocal", "assert", "break",
    "continue", "async",
];

/// A simple statement of a logical line (the line split at its `;`s).
#[derive(Debug, Default)]
struct Piece {
    /// Its first significant byte, if it has one.
    start: Option<usize>,
    /// An `=` outside brackets: an assignment (plain or augmented).
    assigns: bool,
    /// How many times its brackets closed back to the top level.
    closes: usize,
    /// Whether its last significant byte closed its brackets.
    ends_closed: bool,
}

/// A logical line: physical lines joined by brackets, strings or `\`.
#[derive(Debug)]
struct Logical {
    start: usize,
    line: usize,
    indented: bool,
    pieces: Vec<Piece>,
}

/// Reads a module's source as Python's tokenizer would for what [`Last`] needs (strings,
/// comments, brackets, line continuations, `;` and `=` outside brackets): the last logical
/// line, then what its last statement may be.
fn last_statement(code: &str) -> Last {
    let bytes = code.as_bytes();
    let mut depth = 0usize;
    let mut line = 1usize;
    let mut line_start = 0usize;
    let mut current: Option<Logical> = None;
    let mut last: Option<Logical> = None;
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        match byte {
            b'#' => {
                while i < bytes.len() && !matches!(bytes[i], b'\n' | b'\r') {
                    i += 1;
                }
                continue;
            }
            b'\n' | b'\r' => {
                i = after_newline(bytes, i);
                line += 1;
                line_start = i;
                if depth == 0
                    && let Some(done) = current.take()
                {
                    last = Some(done);
                }
                continue;
            }
            b'\\' if matches!(bytes.get(i + 1), Some(b'\n' | b'\r')) => {
                i = after_newline(bytes, i + 1);
                line += 1;
                line_start = i;
                continue;
            }
            b' ' | b'\t' | b'\x0c' => {
                i += 1;
                continue;
            }
            _ => {}
        }
        let logical = current.get_or_insert_with(|| Logical {
            start: i,
            line,
            indented: i != line_start,
            pieces: vec![Piece::default()],
        });
        if byte == b';' && depth == 0 {
            logical.pieces.push(Piece::default());
            i += 1;
            continue;
        }
        let Some(piece) = logical.pieces.last_mut() else {
            break;
        };
        piece.start.get_or_insert(i);
        piece.ends_closed = false;
        match byte {
            b'\'' | b'"' => {
                i = after_string(bytes, i, &mut line, &mut line_start);
                continue;
            }
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    piece.closes += 1;
                    piece.ends_closed = true;
                }
            }
            b'=' if depth == 0 => {
                let before = i.checked_sub(1).map(|at| bytes[at]);
                let comparison = matches!(before, Some(b'=' | b'!' | b'<' | b'>' | b':'))
                    || bytes.get(i + 1) == Some(&b'=');
                piece.assigns |= !comparison;
            }
            _ => {}
        }
        i += 1;
    }
    let Some(logical) = current.or(last) else {
        return Last::Nothing;
    };
    if logical.indented {
        return Last::Nothing;
    }
    let Some((index, piece)) = logical
        .pieces
        .iter()
        .enumerate()
        .rev()
        .find(|(_, piece)| piece.start.is_some())
    else {
        return Last::Nothing;
    };
    let start = piece.start.unwrap_or(logical.start);
    if !maybe_expression(&code[start..], piece) {
        return Last::Nothing;
    }
    if index > 0 {
        return Last::Tree;
    }
    Last::At {
        offset: code[..logical.start].chars().count(),
        line: logical.line,
    }
}

/// Whether a statement that starts `text` (with what the scan saw of it) may be an
/// expression with a value.
fn maybe_expression(text: &str, piece: &Piece) -> bool {
    if piece.assigns || text.starts_with('@') {
        return false;
    }
    let word_len = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    let word = &text[..word_len];
    if STATEMENT_KEYWORDS.contains(&word) {
        return false;
    }
    // `print(...)` alone: None, for certain.
    let print_call = word == "print"
        && text[word_len..].trim_start().starts_with('(')
        && piece.closes == 1
        && piece.ends_closed;
    !print_call
}

/// Where the line after the newline at `at` (`\n`, `\r` or `\r\n`) starts.
fn after_newline(bytes: &[u8], at: usize) -> usize {
    if bytes[at] == b'\r' && bytes.get(at + 1) == Some(&b'\n') {
        at + 2
    } else {
        at + 1
    }
}

/// Where the string literal whose quote is at `at` ends (past its closing quote; at the
/// newline that ends an unterminated one-line string; or the end of the source), counting
/// the lines it spans. A backslash escapes the next character, in raw strings too (`r"\""`
/// is one string).
fn after_string(bytes: &[u8], at: usize, line: &mut usize, line_start: &mut usize) -> usize {
    let quote = bytes[at];
    let triple = bytes.get(at..at + 3) == Some(&[quote; 3][..]);
    let mut i = at + if triple { 3 } else { 1 };
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if i + 1 < bytes.len() => {
                if matches!(bytes[i + 1], b'\n' | b'\r') {
                    i = after_newline(bytes, i + 1);
                    *line += 1;
                    *line_start = i;
                } else {
                    i += 2;
                }
                continue;
            }
            b'\n' | b'\r' if !triple => return i,
            b'\n' | b'\r' => {
                i = after_newline(bytes, i);
                *line += 1;
                *line_start = i;
                continue;
            }
            byte if byte == quote => {
                if !triple {
                    return i + 1;
                }
                if bytes.get(i..i + 3) == Some(&[quote; 3][..]) {
                    return i + 3;
                }
            }
            _ => {}
        }
        i += 1;
    }
    bytes.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(offset: usize, line: usize) -> Last {
        Last::At { offset, line }
    }

    #[test]
    fn a_last_expression_is_found_where_it_starts() {
        let cases: &[(&str, Last)] = &[
            ("x", at(0, 1)),
            ("x = 6\nx * 7", at(6, 2)),
            ("x = 6\nx * 7\n\n# done\n", at(6, 2)),
            ("df.groupby('a').agg(\n    n=1,\n)", at(0, 1)),
            ("a = 1\nf(a,\n  b=2)  # a comment", at(6, 2)),
            ("s = '''\nx\n'''\ns", at(14, 4)),
            ("s = \"a # b\"\ns", at(12, 2)),
            ("x = 1 + \\\n  2\nx", at(14, 3)),
            ("é = 1\né", at(6, 2)),
            ("a = 1\r\nb = 2\r\na + b", at(14, 3)),
            ("x = 1\rx", at(6, 2)),
            ("print(1) or 2", at(0, 1)),
            ("print(1)\nprint", at(9, 2)),
            ("lambda: 1", at(0, 1)),
            ("x == 1", at(0, 1)),
            ("x <= 1", at(0, 1)),
            ("f(a=1)", at(0, 1)),
            ("import os\nos.getcwd()", at(10, 2)),
            ("display({'a': 1})", at(0, 1)),
            ("r'\\'' + x", at(0, 1)),
            ("x = 1; x", Last::Tree),
            ("x = 1; x;", Last::Tree),
        ];
        for (code, expected) in cases {
            assert_eq!(&last_statement(code), expected, "{code:?}");
        }
    }

    #[test]
    fn statements_without_a_value_need_no_note() {
        for code in [
            "",
            "\n\n# only a comment\n",
            "print(1)",
            "print(1 + 1)  # and a comment",
            "x = 1\nprint(\n    x,\n)",
            "x = 1",
            "x += 1",
            "x: int = 1",
            "a, b = 1, 2",
            "import os",
            "from os import path",
            "for i in range(3):\n    i",
            "if True:\n    x = 1\nelse:\n    x",
            "def f():\n    return 1",
            "@decorator\nclass C: pass",
            "del x",
            "x = 1; y = 2",
            "x = 1\n  y",
            "s = '''\nx\n'''",
        ] {
            assert_eq!(last_statement(code), Last::Nothing, "{code:?}");
            assert_eq!(rich_note(code), None, "{code:?}");
        }
    }

    #[test]
    fn the_note_names_what_may_be_shown() {
        assert_eq!(
            rich_note("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()"),
            Some("at=49,3 plot".to_owned())
        );
        assert_eq!(
            rich_note("display({'a': 1})"),
            Some("at=0,1 display".to_owned())
        );
        assert_eq!(rich_note("x = 6\nx * 7"), Some("at=6,2".to_owned()));
        assert_eq!(rich_note("print('plot')"), Some("plot".to_owned()));
    }
}
