//! Command lines a code template runs with no shell and no `python` or `node` binary
//! (WebAssembly): an argv such as `["python", "-c", CODE, ARG…]` is read as CPython's or
//! Node's command line reads it, and run through a launcher ([`super::python_launcher_at`],
//! [`super::javascript_launcher_at`]) that gives the program the `sys.argv`, `__file__` and
//! tracebacks it would have on a laptop. The published contract's `command` and E2B's
//! commands in a WebAssembly sandbox are both read here.

use kiln_core::Language;

use super::{PythonProgram, javascript_launcher_at, python_launcher_at};

/// A command line kiln runs: the language, what it runs, and the program's arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandLine {
    pub language: Language,
    pub program: CommandProgram,
    /// What follows the program: `sys.argv[1:]`, `process.argv.slice(2)`.
    pub args: Vec<String>,
}

/// What a command line runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandProgram {
    /// `python -c CODE`, `node -e CODE`.
    Inline(String),
    /// `python -m MODULE`: a dotted module name (`pkg.mod`).
    Module(String),
    /// `python FILE`, `node FILE`: the path as the command names it (relative to the
    /// workspace, or absolute).
    File(String),
}

/// Why an argv is not a command line kiln runs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandLineError {
    #[error("the command is empty; {}", usage(None))]
    Empty,
    #[error("{program:?} is not a program kiln runs here; {}", usage(None))]
    UnknownProgram { program: String },
    #[error("`{program}` alone is an interactive prompt, which kiln does not run; {}", usage(Some(*.language)))]
    NoProgram { program: String, language: Language },
    #[error("`{program} {flag}` needs {what} after it")]
    MissingValue {
        program: String,
        flag: &'static str,
        what: &'static str,
    },
    #[error("{module:?} is not a module name (pkg.mod)")]
    NotAModule { module: String },
    #[error("`{program}`'s option {flag} is not supported; {}", usage(Some(*.language)))]
    UnsupportedFlag {
        program: String,
        flag: String,
        language: Language,
    },
    #[error("`{program} -e CODE` takes no arguments in kiln; write them into the code")]
    InlineArguments { program: String },
}

/// The command lines kiln runs, for one language or all.
fn usage(language: Option<Language>) -> &'static str {
    match language {
        Some(Language::Python) => {
            "kiln runs `python -c CODE ARG…`, `python -m MODULE ARG…` and `python FILE ARG…`"
        }
        Some(Language::JavaScript) => "kiln runs `node -e CODE` and `node FILE ARG…`",
        _ => {
            "kiln runs `python -c CODE ARG…`, `python -m MODULE ARG…`, `python FILE ARG…`, \
             `node -e CODE` and `node FILE ARG…`"
        }
    }
}

/// Reads `argv` as CPython's (`python`, `python3`) or Node's (`node`, `nodejs`) command line,
/// the program named by its file name (`/usr/bin/python3` too). Options other than `-c`,
/// `-m` (Python) and `-e` (Node) are refused, as is `-` (a program on stdin).
pub fn parse_command_line(argv: &[String]) -> Result<CommandLine, CommandLineError> {
    use CommandLineError as E;
    let (program, rest) = argv.split_first().ok_or(E::Empty)?;
    let (language, inline_flag) = match program.rsplit('/').next() {
        Some("python" | "python3") => (Language::Python, "-c"),
        Some("node" | "nodejs") => (Language::JavaScript, "-e"),
        _ => {
            return Err(E::UnknownProgram {
                program: program.clone(),
            });
        }
    };
    let Some((first, tail)) = rest.split_first() else {
        return Err(E::NoProgram {
            program: program.clone(),
            language,
        });
    };
    let missing = |flag: &'static str, what: &'static str| E::MissingValue {
        program: program.clone(),
        flag,
        what,
    };
    let (run, args) = match first.as_str() {
        flag if flag == inline_flag => {
            let (code, args) = tail
                .split_first()
                .ok_or_else(|| missing(inline_flag, "code"))?;
            if language == Language::JavaScript && !args.is_empty() {
                return Err(E::InlineArguments {
                    program: program.clone(),
                });
            }
            (CommandProgram::Inline(code.clone()), args)
        }
        "-m" if language == Language::Python => {
            let (module, args) = tail
                .split_first()
                .ok_or_else(|| missing("-m", "a module name"))?;
            if !is_module_name(module) {
                return Err(E::NotAModule {
                    module: module.clone(),
                });
            }
            (CommandProgram::Module(module.clone()), args)
        }
        flag if flag.starts_with('-') => {
            return Err(E::UnsupportedFlag {
                program: program.clone(),
                flag: flag.to_owned(),
                language,
            });
        }
        file => (CommandProgram::File(file.to_owned()), tail),
    };
    Ok(CommandLine {
        language,
        program: run,
        args: args.to_vec(),
    })
}

/// Whether `name` is a dotted Python module name (`pkg.mod`), never a path.
fn is_module_name(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|part| {
            part.chars()
                .next()
                .is_some_and(|c| c.is_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_alphanumeric() || c == '_')
        })
}

impl CommandLine {
    /// Code that runs this command line in a guest that sees its workspace at `home`, as
    /// the language's command line would (see [`python_launcher_at`] and
    /// [`javascript_launcher_at`]); `node -e CODE` is its code.
    pub fn launcher_at(&self, home: &str) -> String {
        let python = |program: PythonProgram<'_>| python_launcher_at(&program, &self.args, home);
        match (self.language, &self.program) {
            (Language::JavaScript, CommandProgram::Inline(code)) => code.clone(),
            (Language::JavaScript, CommandProgram::File(file)) => {
                javascript_launcher_at(file, &self.args, home)
            }
            (_, CommandProgram::Inline(code)) => python(PythonProgram::Inline(code)),
            (_, CommandProgram::Module(module)) => python(PythonProgram::Module(module)),
            (_, CommandProgram::File(file)) => python(PythonProgram::Script(file)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn argv(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    fn parse(words: &[&str]) -> Result<CommandLine, CommandLineError> {
        parse_command_line(&argv(words))
    }

    #[test]
    fn python_c_takes_code_and_arguments() -> TestResult {
        let line = parse(&["python", "-c", "import sys; print(sys.argv)", "a", "b c"])?;
        assert_eq!(
            line,
            CommandLine {
                language: Language::Python,
                program: CommandProgram::Inline("import sys; print(sys.argv)".into()),
                args: argv(&["a", "b c"]),
            }
        );
        let code = line.launcher_at("/home/user");
        assert!(
            code.contains(r#"_kiln_sys.argv = ["-c", "a", "b c"]"#),
            "{code}"
        );
        assert!(code.contains(r#""import sys; print(sys.argv)""#), "{code}");
        Ok(())
    }

    #[test]
    fn python3_runs_a_script_with_its_arguments() -> TestResult {
        let line = parse(&["python3", "app/main.py", "x", "-v"])?;
        assert_eq!(
            line,
            CommandLine {
                language: Language::Python,
                program: CommandProgram::File("app/main.py".into()),
                args: argv(&["x", "-v"]),
            }
        );
        let code = line.launcher_at("/workspace");
        assert!(code.contains(r#""/workspace/app/main.py""#), "{code}");
        assert!(
            code.contains(r#"_kiln_sys.path.insert(0, "/workspace/app")"#),
            "{code}"
        );
        Ok(())
    }

    #[test]
    fn python_m_runs_a_dotted_module() -> TestResult {
        let line = parse(&["/usr/bin/python3", "-m", "json.tool", "in.json"])?;
        assert_eq!(
            line,
            CommandLine {
                language: Language::Python,
                program: CommandProgram::Module("json.tool".into()),
                args: argv(&["in.json"]),
            }
        );
        assert!(
            line.launcher_at("/workspace")
                .contains(r#"run_module("json.tool""#)
        );
        for bad in ["../x", "pkg/mod", "1abc", "a..b", "a.", ""] {
            assert_eq!(
                parse(&["python", "-m", bad]).unwrap_err(),
                CommandLineError::NotAModule { module: bad.into() },
                "{bad}"
            );
        }
        Ok(())
    }

    #[test]
    fn node_e_is_its_code_and_node_file_a_launcher() -> TestResult {
        let line = parse(&["node", "-e", "console.log(6*7)"])?;
        assert_eq!(
            line,
            CommandLine {
                language: Language::JavaScript,
                program: CommandProgram::Inline("console.log(6*7)".into()),
                args: Vec::new(),
            }
        );
        assert_eq!(line.launcher_at("/workspace"), "console.log(6*7)");
        let line = parse(&["nodejs", "app/main.js", "a"])?;
        assert_eq!(
            line,
            CommandLine {
                language: Language::JavaScript,
                program: CommandProgram::File("app/main.js".into()),
                args: argv(&["a"]),
            }
        );
        assert!(
            line.launcher_at("/workspace")
                .contains(r#"await import("/workspace/app/main.js")"#)
        );
        assert_eq!(
            parse(&["node", "-e", "1", "x"]).unwrap_err(),
            CommandLineError::InlineArguments {
                program: "node".into()
            }
        );
        Ok(())
    }

    #[test]
    fn empty_and_unknown_commands_are_refused() {
        assert_eq!(parse(&[]).unwrap_err(), CommandLineError::Empty);
        assert_eq!(
            parse(&["ruby", "x.rb"]).unwrap_err(),
            CommandLineError::UnknownProgram {
                program: "ruby".into()
            }
        );
        assert_eq!(
            parse(&["python"]).unwrap_err(),
            CommandLineError::NoProgram {
                program: "python".into(),
                language: Language::Python,
            }
        );
        assert_eq!(
            parse(&["python3", "-c"]).unwrap_err(),
            CommandLineError::MissingValue {
                program: "python3".into(),
                flag: "-c",
                what: "code",
            }
        );
        assert_eq!(
            parse(&["python", "-m"]).unwrap_err(),
            CommandLineError::MissingValue {
                program: "python".into(),
                flag: "-m",
                what: "a module name",
            }
        );
        assert_eq!(
            parse(&["node", "-e"]).unwrap_err(),
            CommandLineError::MissingValue {
                program: "node".into(),
                flag: "-e",
                what: "code",
            }
        );
    }

    #[test]
    fn options_kiln_does_not_take_are_refused_clearly() {
        for (words, flag) in [
            (&["python3", "-V"][..], "-V"),
            (&["python", "-u", "main.py"][..], "-u"),
            (&["python", "-"][..], "-"),
            (&["python", "-e", "1"][..], "-e"),
            (&["node", "-p", "1"][..], "-p"),
            (&["node", "-m", "x"][..], "-m"),
            (&["node", "-c", "1"][..], "-c"),
        ] {
            let CommandLineError::UnsupportedFlag { flag: said, .. } = parse(words).unwrap_err()
            else {
                panic!("{words:?} is not refused for its option");
            };
            assert_eq!(said, flag, "{words:?}");
        }
        assert_eq!(
            parse(&["python3", "-u", "main.py"])
                .unwrap_err()
                .to_string(),
            "`python3`'s option -u is not supported; kiln runs `python -c CODE ARG…`, \
             `python -m MODULE ARG…` and `python FILE ARG…`"
        );
        assert_eq!(
            parse(&["node", "-p", "1"]).unwrap_err().to_string(),
            "`node`'s option -p is not supported; kiln runs `node -e CODE` and `node FILE ARG…`"
        );
    }
}
