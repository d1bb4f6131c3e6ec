#include "checkpoint_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

#include <mxq/ops.hpp>

#include "fail.hpp"
#include "safetensors.hpp"

namespace mxq::cli {

bool default_ignored(const std::string& module) {
  const auto has = [&](const char* s) { return module.find(s) != std::string::npos; };
  return module == "lm_head" || module.ends_with(".lm_head") || has("embed") || module.ends_with(".mlp.gate") ||
         has("router") || module.ends_with("shared_expert_gate") || has("visual") || has("vision");
}

// libstdc++ matches a pattern with its polynomial executor: memory and stack bounded by the pattern,
// time by the pattern times the name, whatever the name (the default executor backtracks, recursing
// per character: a long name overflows the stack).
std::regex user_pattern(const std::string& flag, const std::string& s) {
  try {
#ifdef __GLIBCXX__
    return std::regex(s, std::regex::ECMAScript | std::regex_constants::__polynomial);
#else
    return std::regex(s, std::regex::ECMAScript);
#endif
  } catch (const std::regex_error& e) {
    fail(flag + " '" + s + "': not a usable regular expression (back-references are not supported): " + e.what());
  }
}

std::vector<ExpertsDecl> gpt_oss_experts_tensors(const std::string& name, const std::vector<std::int64_t>& shape) {
  const std::int64_t E = shape.at(0), K = shape.at(1), N = shape.at(2);
  return {{name + "_blocks", "U8", {E, N, K / 32, 16}}, {name + "_scales", "U8", {E, N, K / 32}}};
}

bool gpt_oss_experts_name(const std::string& name) {
  return name.ends_with(".mlp.experts.gate_up_proj") || name.ends_with(".mlp.experts.down_proj");
}

namespace {
struct ExpertsPair {
  const TensorEntry *gate_up = nullptr, *down = nullptr;
  std::string gate_up_key, down_key;
};
}  // namespace

float group_amax_of(float a, float b) { return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b); }

QuantizePlan plan_quantize(const std::vector<TensorEntry>& tensors, const PlanOptions& o) {
  QuantizePlan plan;
  const int g = format_info(o.format).default_group;
  const std::pair<Rotation, int>& rot = o.rotation;
  std::vector<std::string> ignored_modules;
  std::vector<std::string>& unfit = plan.unfit;
  plan.gpt_oss = gpt_oss_layout(o.fake, o.format == Format::mxfp4, o.fusion);
  if (plan.gpt_oss && rot.first != Rotation::none)
    fail("--rotate: gpt-oss's MXFP4 experts layout (--format mxfp4 on a gpt-oss checkpoint) has no rotation");
  std::map<std::string, ExpertsPair> experts;  // gpt-oss: by experts module
  for (const TensorEntry& t : tensors) {
    ++plan.shard_tensors[t.shard];
    TensorPlan p;
    const bool is_weight = t.name.ends_with(".weight");
    const std::string module = is_weight ? t.name.substr(0, t.name.size() - 7) : t.name;
    const bool floating = t.dtype == "BF16" || t.dtype == "F16" || t.dtype == "F32";
    if (plan.gpt_oss) {
      const std::string key = t.shard + "/" + t.name;
      if (gpt_oss_experts_name(t.name)) {
        const std::string what = fmt::format("gpt-oss experts tensor '{}' ({} {})", t.name, t.dtype, st::shape_text(t.shape));
        if (!floating || t.shape.size() != 3)
          fail(what + ": expected a 3-D BF16, F16 or F32 tensor ([E, H, 2I] gate_up_proj, [E, I, H] down_proj)");
        if (t.shape[0] <= 0 || t.shape[1] <= 0 || t.shape[2] <= 0) fail(what + ": empty");
        if (t.shape[1] % 32 != 0)
          fail(what + fmt::format(": its input dimension {} is not a multiple of 32 (gpt-oss's MXFP4 blocks)", t.shape[1]));
        if (t.name.size() + std::strlen("_blocks") > st::kMaxNameBytes)
          fail(what + fmt::format(": name too long for its quantized tensors (limit {} bytes)", st::kMaxNameBytes));
        const std::string em = t.name.substr(0, t.name.rfind('.'));
        ExpertsPair& pair = experts[em];
        const bool gu = t.name.ends_with(".gate_up_proj");
        if (gu ? pair.gate_up != nullptr : pair.down != nullptr) fail(what + ": stored twice in the checkpoint");
        (gu ? pair.gate_up : pair.down) = &t;
        (gu ? pair.gate_up_key : pair.down_key) = key;
        if (!o.include.empty() &&
            std::none_of(o.include.begin(), o.include.end(), [&](const std::regex& r) { return std::regex_search(t.name, r); })) {
          p.why = "not matched by --include";
        } else if (std::any_of(o.exclude.begin(), o.exclude.end(), [&](const std::regex& r) { return std::regex_search(t.name, r); })) {
          p.why = "matched by --exclude";
        } else {
          p.quantize = p.gpt_oss_experts = true;
          const std::int64_t E = t.shape[0], K = t.shape[1], N = t.shape[2];
          const std::size_t xb = std::size_t(E * N * K * st::find_dtype(t.dtype)->bytes);
          Engine::Sizes& largest = plan.largest;
          largest.x = std::max(largest.x, xb);
          largest.y = std::max(largest.y, std::size_t(E * N * code_cols(o.format, K)));
          largest.scales = std::max(largest.scales, std::size_t(E * N * (K / 32)));
          largest.elems = std::max(largest.elems, std::size_t(E * N * K));
        }
      } else if (is_weight && t.shape.size() == 2 && floating) {
        p.why = "gpt-oss's MXFP4 layout quantizes the MoE experts only";
        ignored_modules.push_back(module);
      } else {
        p.why = "not a 2-D floating weight";
      }
      plan.tensors[key] = p;
      continue;
    }
    if (!is_weight || t.shape.size() != 2 || !floating) {
      p.why = "not a 2-D floating weight";
    } else if (default_ignored(module)) {
      p.why = "left unquantized for vLLM (head, embedding, router, vision)";
      ignored_modules.push_back(module);
    } else if (stored_transposed(o.fusion, module)) {
      p.why = "a Conv1D weight stored transposed ([K, N]) in this model family, not a Linear weight";
      ignored_modules.push_back(module);
      unfit.push_back(t.name + " (" + p.why + ")");
    } else if (!o.include.empty() &&
               std::none_of(o.include.begin(), o.include.end(), [&](const std::regex& r) { return std::regex_search(t.name, r); })) {
      p.why = "not matched by --include";
      ignored_modules.push_back(module);
    } else if (std::any_of(o.exclude.begin(), o.exclude.end(), [&](const std::regex& r) { return std::regex_search(t.name, r); })) {
      p.why = "matched by --exclude";
      ignored_modules.push_back(module);
    } else if (!o.fake && module.size() + std::strlen(".weight_global_scale") > st::kMaxNameBytes) {
      // its quantized tensors' names would be longer than a reader accepts
      p.why = fmt::format("name too long for its quantized tensors (limit {} bytes)", st::kMaxNameBytes);
      ignored_modules.push_back(module);
      unfit.push_back(t.name);
    } else if (rot.second && t.shape[1] % rot.second != 0) {
      p.why = fmt::format("K = {} is not a multiple of the rotation size {}", t.shape[1], rot.second);
      ignored_modules.push_back(module);
      unfit.push_back(t.name);
    } else if (t.shape[0] == 0 || t.shape[1] == 0) {
      // Nothing to quantize, and a Linear module without rows or columns has no scales to load:
      // copied as it is and listed, quantize leaves it in the config's ignore list.
      p.why = fmt::format("empty weight [{}, {}]", t.shape[0], t.shape[1]);
      ignored_modules.push_back(module);
      unfit.push_back(t.name);
    } else if (!o.fake && t.shape[1] % g != 0) {
      p.why = fmt::format("K = {} is not a multiple of {} (vLLM could not load it)", t.shape[1], g);
      ignored_modules.push_back(module);
      unfit.push_back(t.name);
    } else {
      p.quantize = true;
      const std::int64_t N = t.shape[0], K = t.shape[1];
      const std::size_t xb = std::size_t(N * K * st::find_dtype(t.dtype)->bytes);
      Engine::Sizes& largest = plan.largest;
      largest.x = std::max(largest.x, xb);
      largest.y = std::max(largest.y, o.fake ? xb : std::size_t(N * code_cols(o.format, K)));
      largest.scales = std::max(largest.scales, std::size_t(N * ((K + g - 1) / g)));
      largest.elems = std::max(largest.elems, std::size_t(N * K));
    }
    plan.tensors[t.shard + "/" + t.name] = p;
  }
  // gpt-oss: each experts module needs both tensors, of one E, H and I; one left out leaves both out.
  for (const auto& [em, pair] : experts) {
    if (!pair.gate_up || !pair.down)
      fail(fmt::format("gpt-oss experts '{}': {} without {}", em, pair.gate_up ? "gate_up_proj" : "down_proj",
                       pair.gate_up ? "down_proj" : "gate_up_proj"));
    const std::vector<std::int64_t>&gu = pair.gate_up->shape, &dn = pair.down->shape;
    if (gu[0] != dn[0] || gu[1] != dn[2] || gu[2] != 2 * dn[1])
      fail(fmt::format("gpt-oss experts '{}': gate_up_proj {} and down_proj {} do not fit [E, H, 2I] and [E, I, H]", em,
                       st::shape_text(gu), st::shape_text(dn)));
    TensorPlan &pg = plan.tensors[pair.gate_up_key], &pd = plan.tensors[pair.down_key];
    if (pg.quantize && pd.quantize) continue;
    const bool g_out = !pg.quantize;
    for (TensorPlan* q : {&pg, &pd})
      if (q->quantize) {
        q->quantize = q->gpt_oss_experts = false;
        q->why = fmt::format("its experts' {} is left unquantized (gpt-oss's layout quantizes both or neither)",
                             g_out ? "gate_up_proj" : "down_proj");
        unfit.push_back((q == &pg ? pair.gate_up : pair.down)->name + " (" + q->why + ")");
      }
    ignored_modules.push_back(em);
  }
  // A fused parameter holds one precision (vLLM refuses a layer with some shards quantized and
  // others not): a member left unquantized (--exclude, --include, a name too long) leaves the whole
  // group unquantized, each member saying why.
  std::map<std::string, std::string> group_unquantized;  // group -> the member that is not quantized
  for (const auto& [key, p] : plan.tensors) {
    if (o.fake) break;  // a fake-quantized copy loads as the original model: no fused precision to keep
    const std::string name = key.substr(key.find('/') + 1);
    if (p.quantize || !name.ends_with(".weight")) continue;
    const std::string gk = fused_group(o.fusion, name.substr(0, name.size() - 7));
    if (!gk.empty() && !group_unquantized.count(gk)) group_unquantized[gk] = name;
  }
  for (auto& [key, p] : plan.tensors) {
    const std::string name = key.substr(key.find('/') + 1);
    if (!p.quantize || p.gpt_oss_experts) continue;
    const std::string module = name.substr(0, name.size() - 7);
    const auto it = group_unquantized.find(fused_group(o.fusion, module));
    if (it == group_unquantized.end()) continue;
    p.quantize = false;
    p.why = "fused into " + it->first + " with " + it->second + ", which is left unquantized";
    ignored_modules.push_back(module);
    unfit.push_back(name + " (fused into " + it->first + " with " + it->second + ", which is left unquantized)");
  }
  // quantize --rotate: every quantized Linear is rotated (its input, online, by the loader; its weight
  // here). Refused where vLLM would not rotate the input: MoE experts, Linear layers with a bias.
  if (rot.first != Rotation::none && !o.fake) {
    std::set<std::string> names;
    for (const auto& [key, p] : plan.tensors) names.insert(key.substr(key.find('/') + 1));
    for (const auto& [key, p] : plan.tensors) {
      if (!p.quantize) continue;
      const std::string name = key.substr(key.find('/') + 1), module = name.substr(0, name.size() - 7);
      if (module.find(".experts.") != std::string::npos)
        fail("--rotate: " + name + " is an MoE expert weight; vLLM applies no online rotation to MoE experts, so a rotated "
             "expert would compute the wrong product there: --exclude the experts (e.g. --exclude '\\.experts\\.') or "
             "drop --rotate");
      if (names.count(module + ".bias"))
        fail("--rotate: " + module + " has a bias; vLLM applies online rotations only to Linear layers without one: "
             "--exclude it or drop --rotate");
    }
    for (const TensorEntry& t : tensors)
      if (plan.quantized(t.shard, t.name)) {
        plan.rotation_shard = t.shard, plan.rotation_module = t.name.substr(0, t.name.size() - 7);
        break;
      }
  }
  std::sort(ignored_modules.begin(), ignored_modules.end());
  ignored_modules.erase(std::unique(ignored_modules.begin(), ignored_modules.end()), ignored_modules.end());
  if (std::find(ignored_modules.begin(), ignored_modules.end(), "lm_head") == ignored_modules.end())
    ignored_modules.insert(ignored_modules.begin(), "lm_head");
  plan.ignore = std::move(ignored_modules);
  return plan;
}

std::map<std::string, ScaleAmax> global_scale_amax(const LoaderFusion& fusion, const std::map<std::string, float>& amax) {
  // the amax of each group: NaN or Inf when a member's is (then S = 1 for every member,
  // docs/numerics.md, and the summary says so)
  std::map<std::string, float> group_amax;
  for (const auto& [m, v] : amax) {
    const std::string gk = fused_group(fusion, m);
    if (!gk.empty()) group_amax[gk] = group_amax.count(gk) ? group_amax_of(group_amax[gk], v) : v;
  }
  std::map<std::string, ScaleAmax> r;
  for (const auto& [m, v] : amax) {
    const std::string gk = fused_group(fusion, m);
    r[m] = gk.empty() ? ScaleAmax{v, ""} : ScaleAmax{group_amax[gk], gk};
  }
  return r;
}

}  // namespace mxq::cli
