//! `strata template …`: the node's templates (name → layer stack), which the E2B API's
//! `templateID` picks. Kept by the node daemon (`e2b_api::TemplateExtension`, persisted in
//! `$STRATA_HOME/api/templates.json`); these commands only ask it.

use anyhow::{anyhow, Result};
use e2b_api::Template;

use crate::cache_cmd::{parse_size, CacheOpts};
use crate::node_cmd::{self, NodeOpts, StoreArg};

#[derive(clap::Subcommand, Debug)]
pub enum TemplateCmd {
    /// Add or replace a template: `set NAME --layer REF…` (first lowest). The first template,
    /// or one set with `--default`, is what a create without a template (the SDK's `base`)
    /// gets.
    Set {
        name: String,
        #[arg(long = "layer", required = true, value_name = "REF")]
        layers: Vec<String>,
        /// CPUs of each sandbox (`0.5`, `2`).
        #[arg(long)]
        cpus: Option<f64>,
        /// Memory of each sandbox (`512MiB`).
        #[arg(long, value_parser = parse_size)]
        memory: Option<u64>,
        #[arg(long)]
        default: bool,
        /// Keep this many ready sandboxes of the stack (a warm pool): a create takes one.
        /// Only for a template without --cpus/--memory (pooled sandboxes have the node's
        /// defaults). 0 empties the pool.
        #[arg(long, default_value_t = 0)]
        pool: u32,
        #[command(flatten)]
        node: NodeOpts,
    },
    /// The node's templates.
    Ls {
        #[command(flatten)]
        node: NodeOpts,
    },
    /// Remove a template (sandboxes of it stay).
    Rm {
        name: String,
        #[command(flatten)]
        node: NodeOpts,
    },
}

fn call<T: serde::de::DeserializeOwned>(
    node: &NodeOpts,
    store: &StoreArg,
    cache: &CacheOpts,
    request: serde_json::Value,
) -> Result<T> {
    let (mut c, _) = node_cmd::connect_or_start(node, store, cache)?;
    c.call_streaming(&request, |_| Ok(()))
        .map_err(|e| anyhow!("{}", e.message))
}

fn print(t: &Template) {
    println!(
        "{}{}\t{}{}",
        t.name,
        if t.default { " (default)" } else { "" },
        t.layers.join(","),
        if t.pool > 0 {
            format!("\tpool {}", t.pool)
        } else {
            String::new()
        }
    );
}

/// `strata template …`.
pub fn run(cmd: TemplateCmd, store: &StoreArg, cache: &CacheOpts, json: bool) -> Result<()> {
    match cmd {
        TemplateCmd::Set {
            name,
            layers,
            cpus,
            memory,
            default,
            pool,
            node,
        } => {
            if pool > 0 && (cpus.is_some() || memory.is_some()) {
                return Err(anyhow!(
                    "--pool: pooled sandboxes have the node's limits; drop --cpus/--memory"
                ));
            }
            if let Some(c) = cpus {
                if !(c > 0.0 && c <= 1024.0) {
                    return Err(anyhow!("--cpus {c} is not between 0 and 1024"));
                }
            }
            let t = Template {
                name,
                layers,
                cpu_millis: cpus.map(|c| (c * 1000.0).round() as u64),
                memory,
                default,
                pool,
                ..Template::default()
            };
            let mut req = serde_json::to_value(&t)?;
            req["op"] = "template_set".into();
            let t: Template = call(&node, store, cache, req)?;
            if json {
                crate::print_json(&t)?;
            } else {
                print(&t);
            }
        }
        TemplateCmd::Ls { node } => {
            let all: Vec<Template> = call(
                &node,
                store,
                cache,
                serde_json::json!({ "op": "template_ls" }),
            )?;
            if json {
                crate::print_json(&all)?;
            } else {
                all.iter().for_each(print);
            }
        }
        TemplateCmd::Rm { name, node } => {
            let t: Template = call(
                &node,
                store,
                cache,
                serde_json::json!({ "op": "template_rm", "name": name }),
            )?;
            if json {
                crate::print_json(&t)?;
            } else {
                print(&t);
            }
        }
    }
    Ok(())
}
